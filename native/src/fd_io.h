// Whole reads and writes on a blocking socket, for the worker's own stream servers (the
// Forward stream and the data plane): EINTR retried, SIGPIPE never raised.
#pragma once

#include <cstddef>

namespace baton {

// Reads exactly n bytes; false at EOF or on an error (the connection is over).
bool read_full(int fd, char * data, size_t n);

// Writes all n bytes (send with MSG_NOSIGNAL); false on an error.
bool write_full(int fd, const char * data, size_t n);

}  // namespace baton
