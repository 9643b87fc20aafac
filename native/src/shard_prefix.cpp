// Shard's prefix cache (shard.h, prefix_cache.h): spare sequences that keep ended sessions'
// prompt prefixes, copied into new sessions with llama.cpp's sequence copy.
//
// With the non-unified KV cache each sequence is a stream of its own: llama_memory_seq_cp
// copies a whole stream (the data at the next decode's memory update, in the order asked, so a
// chain of copies before a decode stays right) and the copy is then cut back to whole blocks
// with llama_memory_seq_rm, which trim_sequence already relies on being exact.
#include "shard.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "llama.h"

namespace baton {

namespace {

ShardStatus check_hashes(const std::vector<std::string> & hashes, uint32_t block_tokens, uint32_t n_ctx) {
    if (block_tokens == 0) {
        return ShardStatus::Invalid("prefix block_tokens must be > 0");
    }
    if (static_cast<uint64_t>(hashes.size()) * block_tokens > n_ctx) {
        return ShardStatus::Invalid(std::to_string(hashes.size()) + " prefix blocks of " +
                                    std::to_string(block_tokens) + " tokens exceed the context of " +
                                    std::to_string(n_ctx) + " positions");
    }
    for (size_t i = 0; i < hashes.size(); ++i) {
        if (hashes[i].size() != kPrefixHashBytes) {
            return ShardStatus::Invalid("prefix block hash " + std::to_string(i) + " has " +
                                        std::to_string(hashes[i].size()) + " bytes, not " +
                                        std::to_string(kPrefixHashBytes));
        }
    }
    return ShardStatus::Ok();
}

}  // namespace

ShardStatus Shard::prefix_lookup(const std::vector<std::string> & hashes, uint32_t block_tokens,
                                 uint32_t * blocks) const {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = check_hashes(hashes, block_tokens, info_.n_ctx_per_sequence);
    if (!st.ok()) {
        return st;
    }
    *blocks = prefix_.match(hashes, block_tokens, nullptr);
    return ShardStatus::Ok();
}

ShardStatus Shard::open_prefix(uint32_t seq_id, std::vector<std::string> hashes, uint32_t block_tokens,
                               uint32_t use_blocks, int32_t * next_position) {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = check_seq_id("seq_id", seq_id);
    if (!st.ok()) {
        return st;
    }
    st = check_hashes(hashes, block_tokens, info_.n_ctx_per_sequence);
    if (!st.ok()) {
        return st;
    }
    if (use_blocks > hashes.size()) {
        return ShardStatus::Invalid("use_blocks " + std::to_string(use_blocks) + " exceeds the " +
                                    std::to_string(hashes.size()) + " block hashes given");
    }
    if (next_positions_[seq_id] != 0) {
        return ShardStatus::Invalid("seq " + std::to_string(seq_id) + " already holds " +
                                    std::to_string(next_positions_[seq_id]) + " positions; a prefix opens an empty one");
    }
    if (use_blocks > 0) {
        uint32_t spare = 0;
        const uint32_t held = prefix_.match(hashes, block_tokens, &spare);
        if (held < use_blocks) {
            prefix_.count_lookup(0, block_tokens);
            publish_prefix_stats();
            return ShardStatus::Precondition("the prefix cache holds " + std::to_string(held) + " of the " +
                                             std::to_string(use_blocks) + " blocks asked (evicted or never kept)");
        }
        llama_memory_t mem = llama_get_memory(ctx_.get());
        llama_memory_seq_cp(mem, static_cast<llama_seq_id>(spare), static_cast<llama_seq_id>(seq_id), -1, -1);
        const int32_t keep = static_cast<int32_t>(use_blocks * block_tokens);
        if (static_cast<uint64_t>(keep) < prefix_.entry_positions(spare) &&
            !llama_memory_seq_rm(mem, static_cast<llama_seq_id>(seq_id), keep, -1)) {
            llama_memory_seq_rm(mem, static_cast<llama_seq_id>(seq_id), -1, -1);
            return ShardStatus::Internal("llama.cpp cannot cut a copied prefix back to " + std::to_string(keep) +
                                         " positions");
        }
        prefix_.touch(spare);
        set_next_position(seq_id, keep);
    }
    prefix_.count_lookup(use_blocks, block_tokens);
    prefix_.remember(seq_id, std::move(hashes), block_tokens);
    publish_prefix_stats();
    *next_position = next_positions_[seq_id];
    return ShardStatus::Ok();
}

void Shard::keep_prefix(uint32_t seq_id) {
    uint32_t blocks = 0;
    uint64_t evicted = 0;
    const int64_t spare = prefix_.take_for_keep(seq_id, next_positions_[seq_id], &blocks, &evicted);
    if (spare < 0) {
        prefix_.forget(seq_id);
        publish_prefix_stats();
        return;
    }
    const auto dst = static_cast<llama_seq_id>(spare);
    const auto keep = static_cast<int32_t>(prefix_.entry_positions(static_cast<uint32_t>(spare)));
    llama_memory_t mem = llama_get_memory(ctx_.get());
    llama_memory_seq_rm(mem, dst, -1, -1);
    llama_memory_seq_cp(mem, static_cast<llama_seq_id>(seq_id), dst, -1, -1);
    if (keep < next_positions_[seq_id] && !llama_memory_seq_rm(mem, dst, keep, -1)) {
        llama_memory_seq_rm(mem, dst, -1, -1);
        prefix_.dropped(static_cast<uint32_t>(spare));
        set_next_position(static_cast<uint32_t>(spare), 0);
        publish_prefix_stats();
        return;
    }
    set_next_position(static_cast<uint32_t>(spare), keep);
    publish_prefix_stats();
}

void Shard::publish_prefix_stats() {
    const PrefixCacheStats s = prefix_.stats();
    prefix_lookups_.store(s.lookups, std::memory_order_relaxed);
    prefix_hits_.store(s.hits, std::memory_order_relaxed);
    prefix_hit_positions_.store(s.hit_positions, std::memory_order_relaxed);
    prefix_kept_.store(s.kept, std::memory_order_relaxed);
    prefix_evicted_.store(s.evicted, std::memory_order_relaxed);
    prefix_entries_.store(s.entries, std::memory_order_relaxed);
    prefix_positions_.store(s.positions, std::memory_order_relaxed);
    std::vector<uint64_t> tags = prefix_.held_tags(SIZE_MAX);
    const std::lock_guard<std::mutex> lock(prefix_tags_mutex_);
    prefix_tags_ = std::move(tags);
}

std::vector<uint64_t> Shard::prefix_held_tags(size_t max) const {
    const std::lock_guard<std::mutex> lock(prefix_tags_mutex_);
    return std::vector<uint64_t>(prefix_tags_.begin(), prefix_tags_.begin() + std::min(max, prefix_tags_.size()));
}

PrefixCacheStats Shard::prefix_cache_stats() const {
    PrefixCacheStats s;
    s.lookups = prefix_lookups_.load(std::memory_order_relaxed);
    s.hits = prefix_hits_.load(std::memory_order_relaxed);
    s.hit_positions = prefix_hit_positions_.load(std::memory_order_relaxed);
    s.kept = prefix_kept_.load(std::memory_order_relaxed);
    s.evicted = prefix_evicted_.load(std::memory_order_relaxed);
    s.entries = prefix_entries_.load(std::memory_order_relaxed);
    s.positions = prefix_positions_.load(std::memory_order_relaxed);
    return s;
}

}  // namespace baton
