/* What a wake costs on this machine, by how long the thread slept and how many pages it
 * touches once awake: the thread's own CPU time (CLOCK_THREAD_CPUTIME_ID) from the wake to
 * the end of its work, averaged over the wakes. On bare metal a page touched again costs a
 * few hundred ns at most, however long the sleep; on some virtual machines, tens of µs once
 * the thread slept a second. A watcher that wakes once a second pays that for every page
 * its beat touches (docs/performance.md, "idle").
 *
 *     cc -O1 -o /tmp/wake_pages benchmarks/wake_pages.c
 *     for s in 0.01 0.1 1; do for p in 4 64 256; do /tmp/wake_pages $p $s; done; done
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long long thread_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PAGES SLEEP_S\n", argv[0]);
        return 2;
    }
    long pages = atol(argv[1]);
    double sleep_s = atof(argv[2]);
    int wakes = sleep_s >= 1 ? 8 : sleep_s >= 0.1 ? 30 : 200;
    char *buf = malloc(pages * 4096);
    if (buf == NULL)
        return 1;
    memset(buf, 1, pages * 4096);
    struct timespec nap = {(time_t)sleep_s, (long)((sleep_s - (time_t)sleep_s) * 1e9)};
    volatile long sum = 0;
    long long total = 0;
    for (int i = 0; i <= wakes; i++) {
        nanosleep(&nap, NULL);
        long long t0 = thread_ns();
        for (long page = 0; page < pages; page++)
            sum += buf[page * 4096];
        if (i > 0)  /* the first wake warms nothing up: left out */
            total += thread_ns() - t0;
    }
    printf("%4ld pages after %5.2f s asleep: %8.1f us a wake (%6.2f us a page), %d wakes\n", pages, sleep_s,
           total / 1e3 / wakes, total / 1e3 / wakes / pages, wakes);
    return 0;
}
