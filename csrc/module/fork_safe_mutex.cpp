// A mutex that a forked child can use: the child has only the forking thread,
// so a lock some other thread held at fork() would never be released there.
#include <rotary/tables.h>

#include <pthread.h>

#include <mutex>
#include <new>
#include <unordered_set>

namespace rotary {

namespace {

// The live ForkSafeMutexes, made anew in a forked child (where only the
// forking thread runs). The registry's own mutex is held across fork().
std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex();  // never destroyed: a handler may run at exit
  return *m;
}
std::unordered_set<detail::ForkSafeMutex*>& registry() {
  static auto* live = new std::unordered_set<detail::ForkSafeMutex*>();
  return *live;
}
void install_fork_handlers() {
  static const int once = pthread_atfork([] { registry_mutex().lock(); }, [] { registry_mutex().unlock(); },
                                         [] {
                                           for (detail::ForkSafeMutex* m : registry()) new (&m->mutex) std::mutex();
                                           registry_mutex().unlock();
                                         });
  (void)once;
}

}  // namespace

detail::ForkSafeMutex::ForkSafeMutex() {
  install_fork_handlers();
  std::lock_guard<std::mutex> guard(registry_mutex());
  registry().insert(this);
}

detail::ForkSafeMutex::~ForkSafeMutex() {
  std::lock_guard<std::mutex> guard(registry_mutex());
  registry().erase(this);
}

}  // namespace rotary
