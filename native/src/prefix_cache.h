// PrefixCache: which spare sequences of a Shard's context hold the KV of which prompt prefixes.
//
// A prompt prefix is a run of whole blocks of block_tokens tokens; block i is named by a chained
// hash H_i = sha256(H_{i-1} || block i's token ids) that the session's owner computes (seeded with
// the recipe, the block size and an optional salt: agent/core/owner/prefix_blocks.py). The worker
// never sees the tokens of a range that is not first, so it compares the hashes only: a chained
// hash names the whole prefix up to its block, and one worker holds one range of one recipe, so
// (this worker, H_i) names the KV of positions [0, (i + 1) * block_tokens) exactly.
//
// Entries live in spare sequence ids [first_spare, first_spare + spares) that no session is
// given. A session opened with its prompt's block hashes (remember) becomes an entry when its
// sequence is removed (take_for_keep names the spare to copy it into, evicting the least
// recently used entry when none is free); a new session copies the longest entry that shares
// its leading blocks (match). Pure bookkeeping: no llama.cpp, no clock (a use counter orders
// entries), so it is tested without a model (native/tests/prefix_cache_tests.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace baton {

inline constexpr size_t kPrefixHashBytes = 32;

// A block hash's first 8 bytes as a little-endian integer: enough to prefer a route (a
// collision only misplaces a preference; the hops compare whole hashes before copying).
uint64_t prefix_tag(const std::string & hash);

struct PrefixCacheStats {
    uint64_t lookups = 0;          // opens that asked for a prefix
    uint64_t hits = 0;             // opens that copied at least one block
    uint64_t hit_positions = 0;    // positions copied instead of computed
    uint64_t kept = 0;             // sessions kept as entries at their end
    uint64_t evicted = 0;          // entries dropped for room
    uint32_t entries = 0;
    uint64_t positions = 0;        // positions the entries hold
};

class PrefixCache {
public:
    // spares: how many spare sequence ids (0: the cache is off); sessions use ids below first_spare.
    PrefixCache(uint32_t first_spare, uint32_t spares);

    bool enabled() const { return !spares_.empty(); }
    uint32_t first_spare() const { return first_spare_; }
    uint32_t spare_count() const { return static_cast<uint32_t>(spares_.size()); }

    // Leading blocks of `hashes` (each kPrefixHashBytes) the longest entry of block_tokens-token
    // blocks holds; *seq_id (when not null) the spare holding them. Touches nothing.
    uint32_t match(const std::vector<std::string> & hashes, uint32_t block_tokens, uint32_t * seq_id) const;
    // Positions the entry in spare seq_id holds (0: none).
    uint64_t entry_positions(uint32_t seq_id) const;
    // Marks the entry in spare seq_id used now (least recently used goes first).
    void touch(uint32_t seq_id);

    // The block hashes of session sequence seq_id's prompt (kept until forget or take_for_keep).
    void remember(uint32_t seq_id, std::vector<std::string> hashes, uint32_t block_tokens);
    void forget(uint32_t seq_id);
    bool remembers(uint32_t seq_id) const;

    // Session sequence seq_id ends holding `positions`: the blocks worth keeping are its
    // remembered hashes cut to positions / block_tokens. Returns the spare to copy it into (its
    // old entry, if any, to be cleared first: *evicted_positions > 0), setting *blocks; or -1
    // when nothing is kept (not remembered, no whole block, an entry already holds them all).
    // The entry is recorded at once; the caller clears the spare, copies, trims to
    // *blocks x block_tokens, and calls dropped() if that failed (the spare is free again).
    int64_t take_for_keep(uint32_t seq_id, int32_t positions, uint32_t * blocks, uint64_t * evicted_positions);
    void dropped(uint32_t spare_seq_id);

    PrefixCacheStats stats() const;
    // What the node reports to the tracker (which routes hold a prompt's prefix): each entry's
    // block hashes as tags (prefix_tag), the most recently used entry first, each entry's
    // leading blocks first, no tag twice, at most `max`. A tag names a prefix as its hash does
    // (a chained hash names every block before it), so the tracker finds how many leading
    // blocks of a prompt an entry holds from the prompt's tags alone.
    std::vector<uint64_t> held_tags(size_t max) const;
    void count_lookup(uint32_t copied_blocks, uint32_t block_tokens);

private:
    struct Entry {
        std::vector<std::string> hashes;  // empty: free
        uint32_t block_tokens = 0;
        uint64_t last_used = 0;
    };
    struct Remembered {
        std::vector<std::string> hashes;
        uint32_t block_tokens = 0;
    };

    Entry * entry(uint32_t seq_id);

    uint32_t first_spare_;
    std::vector<Entry> spares_;          // index: seq_id - first_spare_
    std::vector<Remembered> sessions_;   // index: session seq id (grown as needed)
    uint64_t uses_ = 0;
    PrefixCacheStats stats_;
};

}  // namespace baton
