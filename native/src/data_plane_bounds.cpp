// The data plane's frame bounds: see data_plane_bounds.h.
#include "data_plane_bounds.h"

#include <algorithm>

namespace baton::data_wire {

size_t unproven_frame_bytes(size_t max_rows, size_t max_frame_bytes) {
    return std::min(max_rows * kTokenStepRowBytes + kTokenStepSlackBytes, max_frame_bytes);
}

uint32_t announced_bytes(const unsigned char * prefix) {
    return static_cast<uint32_t>(prefix[0]) | static_cast<uint32_t>(prefix[1]) << 8 |
           static_cast<uint32_t>(prefix[2]) << 16 | static_cast<uint32_t>(prefix[3]) << 24;
}

size_t read_allowance(size_t buffered, size_t frame_limit, size_t chunk_bytes) {
    const size_t most = kPrefixBytes + frame_limit;
    const size_t room = buffered < most ? most - buffered : 0;
    return std::max<size_t>(1, std::min(chunk_bytes, room));
}

}  // namespace baton::data_wire
