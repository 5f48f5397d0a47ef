/* The idle benchmark's floor: a process that does nothing but wake once a second and
 * write a heartbeat-sized record (357 bytes) in place, as a watcher must. What this costs
 * on a machine, no watcher that wakes once a second can go below there.
 *
 *     cc -O2 -o waker _waker.c && ./waker FILE
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s FILE\n", argv[0]);
        return 2;
    }
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    char record[357];
    memset(record, ' ', sizeof record);
    struct timespec beat = {1, 0};
    for (;;) {
        nanosleep(&beat, NULL);
        if (pwrite(fd, record, sizeof record, 0) < 0) {
            perror("pwrite");
            return 1;
        }
    }
}
