// Formats an integer into an exception message: the code path that broke
// when a library carried its own C++ runtime.
#include <sstream>
#include <stdexcept>

extern "C" void rotary_probe_throw(long value) {
  std::ostringstream message;
  message << "start_pos + seq_len = " << value;
  throw std::runtime_error(message.str());
}
