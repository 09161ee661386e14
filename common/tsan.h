/* ThreadSanitizer annotations for hand-offs that an uninstrumented library orders out of TSan's
 * sight: Debian's gRPC hands a tag, and what it allocated for a call, from one thread to another
 * through its completion queue, under locks TSan cannot see. Each use says what gRPC guarantees
 * there. Outside a TSan build (gcc's -fsanitize=thread, or clang's) they compile to nothing. */
#ifndef ZD_COMMON_TSAN_H
#define ZD_COMMON_TSAN_H

#if defined(__SANITIZE_THREAD__)
#define ZD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ZD_TSAN 1
#endif
#endif

#ifdef ZD_TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
/* Everything this thread wrote before is visible to the thread that does ZD_TSAN_ACQUIRE(addr). */
#define ZD_TSAN_RELEASE(addr) __tsan_release(addr)
#define ZD_TSAN_ACQUIRE(addr) __tsan_acquire(addr)
/* The accesses in between are not checked (memory another thread of the library wrote). */
#define ZD_TSAN_IGNORE_BEGIN() __tsan_ignore_thread_begin()
#define ZD_TSAN_IGNORE_END()   __tsan_ignore_thread_end()
#else
#define ZD_TSAN_RELEASE(addr)  ((void)(addr))
#define ZD_TSAN_ACQUIRE(addr)  ((void)(addr))
#define ZD_TSAN_IGNORE_BEGIN() ((void)0)
#define ZD_TSAN_IGNORE_END()   ((void)0)
#endif

#endif /* ZD_COMMON_TSAN_H */
