// CTest cases for the data plane's frame bounds (native/src/data_plane_bounds.h): what an
// unproven connection may announce and how much a read may take, so that the worker's buffer for
// one connection never passes the prefix and the longest frame allowed. No sockets, no threads.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "data_plane_bounds.h"

#include <cstddef>
#include <cstdint>

namespace {

using baton::data_wire::announced_bytes;
using baton::data_wire::kPrefixBytes;
using baton::data_wire::read_allowance;
using baton::data_wire::unproven_frame_bytes;

constexpr size_t kChunk = 1 << 16;
constexpr size_t kSmolFrameBytes = 5'400'000;  // SmolLM2's whole-frame limit, about

}  // namespace

TEST_CASE("an unproven connection may announce an owner's token step of the largest batch, not a frame of rows") {
    CHECK(unproven_frame_bytes(512, kSmolFrameBytes) == 512 * 10 + 4096);
    CHECK(unproven_frame_bytes(2048, kSmolFrameBytes) == 2048 * 10 + 4096);
    // a worker whose whole frame is smaller than that: the whole frame, never more
    CHECK(unproven_frame_bytes(512, 1000) == 1000);
    // the 5.4 MB frame the flood announced is far over it
    CHECK(unproven_frame_bytes(2048, kSmolFrameBytes) < kSmolFrameBytes / 100);
}

TEST_CASE("the prefix is a little-endian u32") {
    const unsigned char small[kPrefixBytes] = {0x10, 0x27, 0, 0};
    CHECK(announced_bytes(small) == 10000);
    const unsigned char most[kPrefixBytes] = {0xff, 0xff, 0xff, 0xff};
    CHECK(announced_bytes(most) == 0xffffffffu);
    const unsigned char smol[kPrefixBytes] = {0xc0, 0x65, 0x52, 0x00};  // 5,400,000
    CHECK(announced_bytes(smol) == kSmolFrameBytes);
}

TEST_CASE("a read never takes a buffer past the prefix and the longest frame allowed") {
    const size_t limit = unproven_frame_bytes(512, kSmolFrameBytes);
    // an empty buffer: the prefix and the frame, not a whole chunk
    CHECK(read_allowance(0, limit, kChunk) == kPrefixBytes + limit);
    // part of a frame held: only what that frame can still need
    CHECK(read_allowance(100, limit, kChunk) == kPrefixBytes + limit - 100);
    // a sender that trickles bytes: the buffer grows to the bound and stops there
    size_t buffered = 0;
    while (buffered < kPrefixBytes + limit) {
        const size_t take = read_allowance(buffered, limit, 7);
        REQUIRE(take <= 7);
        buffered += take;
    }
    CHECK(buffered == kPrefixBytes + limit);
    // a proven connection's frames are long: a read is one chunk, as before
    CHECK(read_allowance(0, kSmolFrameBytes, kChunk) == kChunk);
    CHECK(read_allowance(kSmolFrameBytes - 10, kSmolFrameBytes, kChunk) == kPrefixBytes + 10);
    // never 0 (a read of 0 bytes would look like the peer closing)
    CHECK(read_allowance(kPrefixBytes + limit, limit, kChunk) == 1);
    CHECK(read_allowance(10 * limit, limit, kChunk) == 1);
}
