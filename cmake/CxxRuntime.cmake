# The extension must share the process's C++ runtime (libstdc++.so.6) with
# torch and Python. A private static copy inside librotary (-static-libstdc++,
# or a link line on which -lstdc++ finds a broken libstdc++.so link and falls
# back to the libstdc++.a beside it) gives two runtimes in one process: error
# messages that format a number are cut short, or crash. So:
#   - a static runtime asked for in the flags is refused at configure time;
#   - every library links the shared runtime by its full path, ahead of the
#     driver's own -lstdc++, whatever CXX / CUDAHOSTCXX and their implicit
#     link directories say;
#   - the linked result is checked after every link (check_cxx_runtime.sh).

foreach(_flags_var CMAKE_SHARED_LINKER_FLAGS CMAKE_MODULE_LINKER_FLAGS CMAKE_EXE_LINKER_FLAGS CMAKE_CXX_FLAGS)
  if("${${_flags_var}}" MATCHES "-static-libstdc\\+\\+")
    message(FATAL_ERROR
      "rotary: ${_flags_var} asks for a static C++ runtime (${${_flags_var}}). rotary must use the shared "
      "libstdc++.so.6 that torch and Python load: two runtimes in one process break exceptions and error "
      "messages. Remove -static-libstdc++.")
  endif()
endforeach()

set(ROTARY_CXX_RUNTIME "" CACHE FILEPATH "The shared C++ runtime rotary links by full path (found when empty)")
set(ROTARY_CXX_RUNTIME_CHECK "${CMAKE_CURRENT_LIST_DIR}/check_cxx_runtime.sh")
if(NOT ROTARY_CXX_RUNTIME AND (CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR CMAKE_CXX_COMPILER_ID STREQUAL "Clang"))
  # The compiler's own shared runtime when it has a usable one (EXISTS
  # follows links: a broken libstdc++.so fails it), else the system's.
  execute_process(
    COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
    OUTPUT_VARIABLE _rotary_stdcxx OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT IS_ABSOLUTE "${_rotary_stdcxx}" OR NOT EXISTS "${_rotary_stdcxx}")
    message(STATUS "rotary: ${CMAKE_CXX_COMPILER} has no usable libstdc++.so ('${_rotary_stdcxx}')")
    find_file(_rotary_stdcxx_sys libstdc++.so.6
      PATHS /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /lib/x86_64-linux-gnu /lib64
      NO_DEFAULT_PATH NO_CACHE)
    if(NOT _rotary_stdcxx_sys)
      message(FATAL_ERROR
        "rotary: no shared libstdc++ found for ${CMAKE_CXX_COMPILER}; the linker would embed libstdc++.a. "
        "Pass -DROTARY_CXX_RUNTIME=/path/to/libstdc++.so.6 or use another compiler.")
    endif()
    set(_rotary_stdcxx "${_rotary_stdcxx_sys}")
  endif()
  get_filename_component(_rotary_stdcxx "${_rotary_stdcxx}" REALPATH)
  set(ROTARY_CXX_RUNTIME "${_rotary_stdcxx}" CACHE FILEPATH "" FORCE)
endif()
message(STATUS "rotary: C++ runtime linked shared: ${ROTARY_CXX_RUNTIME}")

# Links the shared runtime by full path and checks the linked file.
function(rotary_use_shared_cxx_runtime target)
  if(ROTARY_CXX_RUNTIME)
    target_link_libraries(${target} PRIVATE "${ROTARY_CXX_RUNTIME}")
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND bash "${ROTARY_CXX_RUNTIME_CHECK}" "$<TARGET_FILE:${target}>"
      VERBATIM)
  endif()
endfunction()
