// Framing and socket helpers of the data plane (data_plane.h), shared by its files: the length
// prefix, NOTICE and sealed frames, and TCP socket setup and dialling. Internal: only the
// data_plane*.cpp files include it.
#pragma once

#include "worker.pb.h"

#include "data_plane_bounds.h"
#include "shard.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace baton::data_wire {

// hex of bytes (session ids in messages)
std::string hex_of(const std::string & bytes);
// prefix + DataFrame, one buffer so that it is one send()
std::string framed(const worker::v1::DataFrame & frame);
std::string notice_frame(const std::string & session_id, const std::string & text);
// A whole frame (length prefix included) of kind carrying body sealed under key; false (and a
// line on stderr) only when OpenSSL fails.
bool sealed_frame(const std::string & key, worker::v1::DataFrameKind kind, const std::string & sid, uint64_t counter,
                  const std::string & body, std::string * out);
// The gRPC status code number of a Shard error code (what a refused step carries).
uint32_t grpc_code(ErrorCode code);
// TCP_NODELAY, keepalive and the send timeout on a connected socket.
void set_socket_options(int fd);
// A connected TCP socket to host:port, or -1 and *error.
int dial(const std::string & host, uint16_t port, std::string * error);

}  // namespace baton::data_wire
