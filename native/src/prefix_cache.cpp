// PrefixCache (prefix_cache.h): spare sequences holding the KV of prompt prefixes, by block hash.
#include "prefix_cache.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

namespace baton {

PrefixCache::PrefixCache(uint32_t first_spare, uint32_t spares) : first_spare_(first_spare), spares_(spares) {}

PrefixCache::Entry * PrefixCache::entry(uint32_t seq_id) {
    if (seq_id < first_spare_ || seq_id - first_spare_ >= spares_.size()) {
        return nullptr;
    }
    return &spares_[seq_id - first_spare_];
}

uint32_t PrefixCache::match(const std::vector<std::string> & hashes, uint32_t block_tokens, uint32_t * seq_id) const {
    uint32_t best = 0;
    for (size_t i = 0; i < spares_.size(); ++i) {
        const Entry & e = spares_[i];
        if (e.hashes.empty() || e.block_tokens != block_tokens) {
            continue;
        }
        // chained hashes: the first block that differs ends the shared prefix
        const size_t n = std::min(e.hashes.size(), hashes.size());
        uint32_t shared = 0;
        while (shared < n && e.hashes[shared] == hashes[shared]) {
            ++shared;
        }
        if (shared > best) {
            best = shared;
            if (seq_id != nullptr) {
                *seq_id = first_spare_ + static_cast<uint32_t>(i);
            }
        }
    }
    return best;
}

uint64_t PrefixCache::entry_positions(uint32_t seq_id) const {
    if (seq_id < first_spare_ || seq_id - first_spare_ >= spares_.size()) {
        return 0;
    }
    const Entry & e = spares_[seq_id - first_spare_];
    return static_cast<uint64_t>(e.hashes.size()) * e.block_tokens;
}

void PrefixCache::touch(uint32_t seq_id) {
    if (Entry * e = entry(seq_id); e != nullptr && !e->hashes.empty()) {
        e->last_used = ++uses_;
    }
}

void PrefixCache::remember(uint32_t seq_id, std::vector<std::string> hashes, uint32_t block_tokens) {
    if (seq_id >= sessions_.size()) {
        sessions_.resize(static_cast<size_t>(seq_id) + 1);
    }
    sessions_[seq_id] = Remembered{std::move(hashes), block_tokens};
}

void PrefixCache::forget(uint32_t seq_id) {
    if (seq_id < sessions_.size()) {
        sessions_[seq_id] = Remembered{};
    }
}

bool PrefixCache::remembers(uint32_t seq_id) const {
    return seq_id < sessions_.size() && !sessions_[seq_id].hashes.empty();
}

int64_t PrefixCache::take_for_keep(uint32_t seq_id, int32_t positions, uint32_t * blocks, uint64_t * evicted_positions) {
    *blocks = 0;
    *evicted_positions = 0;
    if (!enabled() || !remembers(seq_id) || positions <= 0) {
        return -1;
    }
    Remembered session = std::move(sessions_[seq_id]);
    sessions_[seq_id] = Remembered{};
    const uint32_t whole = static_cast<uint32_t>(positions) / session.block_tokens;
    const uint32_t n = std::min<uint32_t>(whole, static_cast<uint32_t>(session.hashes.size()));
    if (n == 0) {
        return -1;
    }
    session.hashes.resize(n);
    uint32_t holder = 0;
    if (match(session.hashes, session.block_tokens, &holder) >= n) {
        touch(holder);  // held already, as long or longer
        return -1;
    }
    // an entry that is a prefix of this one (it adds nothing), else a free spare, else the LRU
    size_t pick = spares_.size();
    for (size_t i = 0; i < spares_.size() && pick == spares_.size(); ++i) {
        const Entry & e = spares_[i];
        if (e.block_tokens == session.block_tokens && e.hashes.size() < n &&
            std::equal(e.hashes.begin(), e.hashes.end(), session.hashes.begin())) {
            pick = i;
        }
    }
    for (size_t i = 0; i < spares_.size() && pick == spares_.size(); ++i) {
        if (spares_[i].hashes.empty()) {
            pick = i;
        }
    }
    if (pick == spares_.size()) {
        pick = 0;
        for (size_t i = 1; i < spares_.size(); ++i) {
            if (spares_[i].last_used < spares_[pick].last_used) {
                pick = i;
            }
        }
    }
    Entry & e = spares_[pick];
    if (!e.hashes.empty()) {
        *evicted_positions = static_cast<uint64_t>(e.hashes.size()) * e.block_tokens;
        ++stats_.evicted;
    }
    e.hashes = std::move(session.hashes);
    e.block_tokens = session.block_tokens;
    e.last_used = ++uses_;
    ++stats_.kept;
    *blocks = n;
    return static_cast<int64_t>(first_spare_) + static_cast<int64_t>(pick);
}

void PrefixCache::dropped(uint32_t spare_seq_id) {
    if (Entry * e = entry(spare_seq_id); e != nullptr) {
        *e = Entry{};
    }
}

void PrefixCache::count_lookup(uint32_t copied_blocks, uint32_t block_tokens) {
    ++stats_.lookups;
    if (copied_blocks > 0) {
        ++stats_.hits;
        stats_.hit_positions += static_cast<uint64_t>(copied_blocks) * block_tokens;
    }
}

uint64_t prefix_tag(const std::string & hash) {
    uint64_t tag = 0;
    for (size_t i = 0; i < 8 && i < hash.size(); ++i) {
        tag |= static_cast<uint64_t>(static_cast<unsigned char>(hash[i])) << (8 * i);
    }
    return tag;
}

std::vector<uint64_t> PrefixCache::held_tags(size_t max) const {
    std::vector<const Entry *> entries;
    for (const Entry & e : spares_) {
        if (!e.hashes.empty()) {
            entries.push_back(&e);
        }
    }
    std::sort(entries.begin(), entries.end(), [](const Entry * a, const Entry * b) { return a->last_used > b->last_used; });
    std::vector<uint64_t> tags;
    std::unordered_set<uint64_t> seen;
    for (const Entry * e : entries) {
        for (const std::string & hash : e->hashes) {
            if (tags.size() >= max) {
                return tags;
            }
            if (const uint64_t tag = prefix_tag(hash); seen.insert(tag).second) {
                tags.push_back(tag);
            }
        }
    }
    return tags;
}

PrefixCacheStats PrefixCache::stats() const {
    PrefixCacheStats s = stats_;
    s.entries = 0;
    s.positions = 0;
    for (const Entry & e : spares_) {
        if (!e.hashes.empty()) {
            ++s.entries;
            s.positions += static_cast<uint64_t>(e.hashes.size()) * e.block_tokens;
        }
    }
    return s;
}

}  // namespace baton
