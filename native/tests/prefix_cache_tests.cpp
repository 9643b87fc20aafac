// CTest cases for PrefixCache (native/src/prefix_cache.h): which spare sequence holds which
// prompt prefix, matching, keeping and LRU eviction. `baton-prefix-cache-tests`; no model.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "prefix_cache.h"

#include <string>
#include <vector>

namespace {

using baton::PrefixCache;

// Block hashes named by a letter and an index: a chain "a0 a1 a2" shares its first two blocks
// with "a0 a1 b2" (the owner's chained hashes make a shared block imply a shared prefix).
std::vector<std::string> chain(const std::string & letters) {
    std::vector<std::string> out;
    for (size_t i = 0; i < letters.size(); ++i) {
        out.push_back(std::string(1, letters[i]) + std::to_string(i) + std::string(30, '.'));
    }
    return out;
}

// Keeps session sequence `seq`'s remembered prefix, as the Shard does at its removal.
int64_t keep(PrefixCache & cache, uint32_t seq, const std::string & letters, uint32_t block_tokens, int32_t positions) {
    cache.remember(seq, chain(letters), block_tokens);
    uint32_t blocks = 0;
    uint64_t evicted = 0;
    return cache.take_for_keep(seq, positions, &blocks, &evicted);
}

}  // namespace

TEST_CASE("an off cache keeps nothing and matches nothing") {
    PrefixCache cache(4, 0);
    CHECK_FALSE(cache.enabled());
    CHECK(keep(cache, 0, "aaa", 4, 12) == -1);
    CHECK(cache.match(chain("aaa"), 4, nullptr) == 0);
}

TEST_CASE("a kept session's whole blocks match a later prompt's leading blocks") {
    PrefixCache cache(4, 2);
    // 11 positions of 4-token blocks: two whole blocks are kept, the third is not whole
    cache.remember(1, chain("aaa"), 4);
    uint32_t blocks = 0;
    uint64_t evicted = 0;
    CHECK(cache.take_for_keep(1, 11, &blocks, &evicted) == 4);
    CHECK(blocks == 2);
    CHECK(evicted == 0);
    CHECK_FALSE(cache.remembers(1));
    uint32_t seq = 0;
    CHECK(cache.match(chain("aaaa"), 4, &seq) == 2);
    CHECK(seq == 4);
    CHECK(cache.match(chain("aba"), 4, nullptr) == 1);
    CHECK(cache.match(chain("b"), 4, nullptr) == 0);
    CHECK(cache.match(chain("aaa"), 8, nullptr) == 0);  // another block size: another name
    CHECK(cache.stats().entries == 1);
    CHECK(cache.stats().positions == 8);
}

TEST_CASE("nothing is kept without a whole block, or when an entry holds it already") {
    PrefixCache cache(2, 2);
    CHECK(keep(cache, 0, "aa", 4, 3) == -1);
    CHECK(keep(cache, 0, "aa", 4, 8) == 2);
    CHECK(keep(cache, 1, "a", 4, 4) == -1);  // a prefix of the entry: held
    CHECK(keep(cache, 1, "aab", 4, 12) == 2);  // longer: it replaces the entry that is its prefix
    CHECK(cache.stats().entries == 1);
    CHECK(cache.stats().positions == 12);
}

TEST_CASE("the least recently used entry makes room") {
    PrefixCache cache(8, 2);
    CHECK(keep(cache, 0, "a", 4, 4) == 8);
    CHECK(keep(cache, 0, "b", 4, 4) == 9);
    uint32_t seq = 0;
    CHECK(cache.match(chain("a"), 4, &seq) == 1);
    cache.touch(seq);  // "a" used after "b": "b" goes first
    cache.remember(0, chain("c"), 4);
    uint32_t blocks = 0;
    uint64_t evicted = 0;
    CHECK(cache.take_for_keep(0, 4, &blocks, &evicted) == 9);
    CHECK(evicted == 4);
    CHECK(cache.match(chain("b"), 4, nullptr) == 0);
    CHECK(cache.match(chain("a"), 4, nullptr) == 1);
    CHECK(cache.stats().evicted == 1);
    cache.dropped(9);  // a failed copy frees its spare
    CHECK(cache.match(chain("c"), 4, nullptr) == 0);
    CHECK(cache.stats().entries == 1);
}

TEST_CASE("a forgotten session is not kept; lookups are counted") {
    PrefixCache cache(1, 1);
    cache.remember(0, chain("aa"), 2);
    cache.forget(0);
    uint32_t blocks = 0;
    uint64_t evicted = 0;
    CHECK(cache.take_for_keep(0, 4, &blocks, &evicted) == -1);
    cache.count_lookup(0, 2);
    cache.count_lookup(3, 2);
    CHECK(cache.stats().lookups == 2);
    CHECK(cache.stats().hits == 1);
    CHECK(cache.stats().hit_positions == 6);
}

TEST_CASE("held tags: the most recently used entry first, its leading blocks first, no tag twice, at most max") {
    PrefixCache cache(4, 3);
    CHECK(cache.held_tags(10).empty());
    CHECK(keep(cache, 0, "ab", 4, 8) == 4);   // a0 b1
    CHECK(keep(cache, 0, "ac", 4, 8) == 5);   // a0 c1: shares a0
    using baton::prefix_tag;
    const std::vector<uint64_t> all = {prefix_tag(chain("ac")[0]), prefix_tag(chain("ac")[1]),
                                       prefix_tag(chain("ab")[1])};
    CHECK(cache.held_tags(10) == all);
    CHECK(cache.held_tags(2) == std::vector<uint64_t>(all.begin(), all.begin() + 2));
    cache.touch(4);  // "ab" used last: first
    CHECK(cache.held_tags(10)[1] == prefix_tag(chain("ab")[1]));
    CHECK(cache.held_tags(0).empty());
}

TEST_CASE("a tag is the hash's first 8 bytes, little-endian") {
    std::string hash(32, '\0');
    hash[0] = '\x01';
    hash[7] = '\x80';
    hash[8] = '\xff';  // past the tag
    CHECK(baton::prefix_tag(hash) == 0x8000000000000001ULL);
}
