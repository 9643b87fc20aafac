// How much a data-plane connection may make the worker buffer (data_plane.h, "Proven before
// buffered"): the length prefix, the longest frame an unproven connection may announce, and how
// many bytes one read may take. Pure: no sockets, no state; the ctest data_plane_bounds checks it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace baton::data_wire {

inline constexpr size_t kPrefixBytes = 4;  // little-endian u32 length
// An owner's token step, per row at most: a position and a token id, each a varint of at most
// 5 bytes (protobuf's packed int32, not negative).
inline constexpr size_t kTokenStepRowBytes = 10;
// Beside a token step's rows: the DataFrame envelope (session id, counter), the GCM tag and the
// step's other fields.
inline constexpr size_t kTokenStepSlackBytes = 4096;

// The longest frame an unproven connection may announce: the largest frame a peer legitimately
// opens a connection with, an owner's token step of max_rows rows (a worker takes no more in
// one Forward), never above max_frame_bytes. Frames with rows (a STEP from the range before)
// come after a HELLO has proven the connection.
size_t unproven_frame_bytes(size_t max_rows, size_t max_frame_bytes);

// The length a frame's prefix announces (kPrefixBytes at prefix).
uint32_t announced_bytes(const unsigned char * prefix);

// How many bytes the next read may append to a buffer of `buffered` bytes that hold no whole
// frame, when a frame may be at most frame_limit bytes: at most chunk_bytes, and never past the
// end of the longest frame allowed (its prefix included), so that the buffer never holds more
// than kPrefixBytes + frame_limit. At least 1.
size_t read_allowance(size_t buffered, size_t frame_limit, size_t chunk_bytes);

}  // namespace baton::data_wire
