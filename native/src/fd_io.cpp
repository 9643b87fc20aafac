// Whole reads and writes on a blocking socket: see fd_io.h.
#include "fd_io.h"

#include <cerrno>

#include <sys/socket.h>
#include <unistd.h>

namespace baton {

bool read_full(int fd, char * data, size_t n) {
    while (n > 0) {
        const ssize_t got = ::read(fd, data, n);
        if (got > 0) {
            data += got;
            n -= static_cast<size_t>(got);
        } else if (got < 0 && errno == EINTR) {
            continue;
        } else {
            return false;  // EOF or an error: the connection is over
        }
    }
    return true;
}

bool write_full(int fd, const char * data, size_t n) {
    while (n > 0) {
        const ssize_t put = ::send(fd, data, n, MSG_NOSIGNAL);
        if (put > 0) {
            data += put;
            n -= static_cast<size_t>(put);
        } else if (put < 0 && errno == EINTR) {
            continue;
        } else {
            return false;
        }
    }
    return true;
}

}  // namespace baton
