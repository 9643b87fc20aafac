// The pure half of shard.h: build and recipe facts, boundary schemas, and every rule a Forward
// request must satisfy (validate_forward and its parts), testable without a model. Split from
// shard.cpp, which owns the llama_model/llama_context lifetimes: these rules need no context.
#include "shard.h"
#include "wire_codec.h"

#include "sha256.h"

#include "llama.h"
#include "llama-ext.h"  // llama_get_memory_breakdown (C++, exported)

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_set>

#ifndef BATON_LLAMA_COMMIT
#define BATON_LLAMA_COMMIT "unknown"
#endif
#ifndef BATON_PATCH_SERIES_SHA256
#define BATON_PATCH_SERIES_SHA256 "unknown"
#endif

namespace baton {

const char * built_llama_cpp_commit() { return BATON_LLAMA_COMMIT; }

std::string runtime_version_json() {
    ggml_backend_load_all();
    std::string backends;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        backends += std::string(i ? ", " : "") + "\"" + ggml_backend_reg_name(ggml_backend_reg_get(i)) + "\"";
    }
    std::string devices;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free_bytes = 0;
        size_t total_bytes = 0;
        ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
        devices += std::string(i ? ", " : "") + "{\"backend\": \"" +
                   ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)) + "\", \"name\": \"" +
                   ggml_backend_dev_name(dev) + "\", \"total_bytes\": " + std::to_string(total_bytes) +
                   ", \"free_bytes\": " + std::to_string(free_bytes) + "}";
    }
    return std::string("{\"llama_cpp_commit\": \"") + built_llama_cpp_commit() + "\", \"patch_series_sha256\": \"" +
           built_patch_series_sha256() + "\", \"backends\": [" + backends + "], \"devices\": [" + devices + "]}\n";
}
const char * built_patch_series_sha256() { return BATON_PATCH_SERIES_SHA256; }

size_t boundary_dtype_size(BoundaryDType dtype) {
    switch (dtype) {
        case BoundaryDType::kF32: return 4;
        case BoundaryDType::kF16: return 2;
        default: return 0;
    }
}

const char * BoundarySchemaDesc::name() const {
    return version == kBoundaryStreamsSchemaVersion ? kBoundaryStreamsSchemaName : kBoundarySchemaName;
}

std::string BoundarySchemaDesc::describe() const {
    return recipe_tag() + " (" + std::to_string(streams) + (streams == 1 ? " stream" : " streams") + " x " +
           std::to_string(n_embd) + " values per token)";
}

std::string BoundarySchemaDesc::recipe_tag() const {
    return std::string(name()) + "/" + std::to_string(version);
}

BoundarySchemaDesc boundary_schema_for(uint32_t hc_streams, uint32_t n_embd) {
    BoundarySchemaDesc d;
    d.n_embd = n_embd;
    if (hc_streams > 1) {
        d.version = kBoundaryStreamsSchemaVersion;
        d.streams = hc_streams;
    }
    return d;
}

ShardStatus check_boundary_schema(size_t entry, uint32_t seq_id, const BoundarySchemaDesc & expected,
                                  uint32_t declared_version, uint32_t declared_streams) {
    const uint32_t version = declared_version == 0 ? kBoundarySchemaVersion : declared_version;
    const uint32_t streams = declared_streams == 0 ? 1 : declared_streams;
    if (version != kBoundarySchemaVersion && version != kBoundaryStreamsSchemaVersion) {
        return ShardStatus::Invalid("entry " + std::to_string(entry) + " (seq " + std::to_string(seq_id) +
                                    "): boundary_schema_version " + std::to_string(version) +
                                    " is unknown; this range takes " + expected.describe());
    }
    BoundarySchemaDesc sent = expected;
    sent.version = version;
    sent.streams = streams;
    if (version != expected.version) {
        return ShardStatus::Invalid("entry " + std::to_string(entry) + " (seq " + std::to_string(seq_id) +
                                    "): boundary rows of schema " + sent.recipe_tag() + " (" +
                                    std::to_string(streams) + (streams == 1 ? " stream" : " streams") +
                                    ") sent to a range that takes " + expected.describe() +
                                    (declared_version == 0 ? "; boundary_schema_version was unset (read as 1)" : ""));
    }
    if (streams != expected.streams) {
        return ShardStatus::Invalid("entry " + std::to_string(entry) + " (seq " + std::to_string(seq_id) +
                                    "): boundary_streams " + std::to_string(streams) + " does not match " +
                                    expected.describe() + ", which has " + std::to_string(expected.streams) +
                                    (expected.streams == 1 ? " stream" : " streams"));
    }
    return ShardStatus::Ok();
}

std::string compute_recipe_hash(const std::string & model_sha256, const std::string & llama_commit,
                                const std::string & patch_series_sha256, const std::string & backend,
                                const std::string & boundary_schema_tag) {
    std::string joined;
    for (const std::string & part : {model_sha256, llama_commit, patch_series_sha256, backend, boundary_schema_tag,
                                     std::string(kBoundaryWireDType)}) {
        if (!joined.empty()) {
            joined.push_back('\n');
        }
        joined += part;
    }
    return sha256_hex(joined);
}

// ---------------------------------------------------------------------------------------------
// Pure validation helpers

namespace {

std::string entry_name(size_t entry, uint32_t seq_id) {
    return "entry " + std::to_string(entry) + " (seq " + std::to_string(seq_id) + ")";
}

std::string range_name(uint32_t begin, uint32_t end) {
    return "[" + std::to_string(begin) + "," + std::to_string(end) + ")";
}

template <typename T>
std::string preview(const std::vector<T> & values, size_t max_shown = 8) {
    std::ostringstream out;
    for (size_t i = 0; i < values.size() && i < max_shown; ++i) {
        out << (i ? ", " : "") << values[i];
    }
    if (values.size() > max_shown) {
        out << ", ... (" << values.size() << " rows)";
    }
    return out.str();
}

}  // namespace

ShardStatus check_schema_version(uint32_t schema_version) {
    if (schema_version != kWorkerSchemaVersion) {
        return ShardStatus::Invalid("schema_version " + std::to_string(schema_version) +
                                    " is not supported (this worker speaks " + std::to_string(kWorkerSchemaVersion) + ")");
    }
    return ShardStatus::Ok();
}

ShardStatus check_positions(uint32_t seq_id, const std::vector<int32_t> & positions, int32_t next) {
    for (size_t r = 0; r < positions.size(); ++r) {
        if (static_cast<int64_t>(positions[r]) != static_cast<int64_t>(next) + static_cast<int64_t>(r)) {
            return ShardStatus::Invalid("positions for seq " + std::to_string(seq_id) + " must start at " +
                                        std::to_string(next) + " and increase by 1; got " + preview(positions) +
                                        " (row " + std::to_string(r) + " is wrong)");
        }
    }
    return ShardStatus::Ok();
}

ShardStatus check_boundary_bytes(size_t entry, uint32_t seq_id, size_t got_bytes, size_t n_rows,
                                 size_t n_embd, size_t elem_size) {
    const size_t row_bytes = n_embd * elem_size;
    const size_t expected = n_rows * row_bytes;
    if (got_bytes == expected) {
        return ShardStatus::Ok();
    }
    if (row_bytes > 0 && got_bytes % row_bytes == 0) {
        return ShardStatus::Invalid(entry_name(entry, seq_id) + ": " + std::to_string(n_rows) + " positions but " +
                                    std::to_string(got_bytes / row_bytes) + " boundary rows of " +
                                    std::to_string(row_bytes) + " bytes");
    }
    return ShardStatus::Invalid(entry_name(entry, seq_id) + ": row width: got " + std::to_string(got_bytes) +
                                " bytes, expected " + std::to_string(n_rows) + " rows x " + std::to_string(n_embd) +
                                " values x " + std::to_string(elem_size) + " bytes = " + std::to_string(expected));
}

int64_t find_non_finite_f32(const void * data, size_t n_values) {
    // Exponent all ones = Inf or NaN. Branch-free block scan (vectorisable), then locate.
    const unsigned char * p = static_cast<const unsigned char *>(data);
    constexpr size_t kBlock = 4096;
    for (size_t start = 0; start < n_values; start += kBlock) {
        const size_t end = std::min(n_values, start + kBlock);
        uint32_t bad = 0;
        for (size_t i = start; i < end; ++i) {
            uint32_t bits;
            std::memcpy(&bits, p + 4 * i, 4);
            bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
        }
        if (bad) {
            for (size_t i = start; i < end; ++i) {
                uint32_t bits;
                std::memcpy(&bits, p + 4 * i, 4);
                if ((bits & 0x7f800000u) == 0x7f800000u) {
                    return static_cast<int64_t>(i);
                }
            }
        }
    }
    return -1;
}

int64_t find_non_finite_f16(const void * data, size_t n_values) {
    const unsigned char * p = static_cast<const unsigned char *>(data);
    for (size_t i = 0; i < n_values; ++i) {
        uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);
        if ((bits & 0x7c00u) == 0x7c00u) {
            return static_cast<int64_t>(i);
        }
    }
    return -1;
}

int64_t find_duplicate_seq_id(const std::vector<uint32_t> & seq_ids) {
    std::unordered_set<uint32_t> seen;
    for (size_t i = 0; i < seq_ids.size(); ++i) {
        if (!seen.insert(seq_ids[i]).second) {
            return static_cast<int64_t>(i);
        }
    }
    return -1;
}

ShardStatus check_batch_rows(size_t total_rows, uint32_t n_batch_max) {
    if (total_rows > n_batch_max) {
        return ShardStatus::Exhausted("batch of " + std::to_string(total_rows) + " rows exceeds the limit of " +
                                      std::to_string(n_batch_max));
    }
    return ShardStatus::Ok();
}

ShardStatus check_context_room(uint32_t seq_id, int32_t next, size_t n_rows, uint32_t n_ctx_per_sequence) {
    if (static_cast<uint64_t>(next) + n_rows > n_ctx_per_sequence) {
        return ShardStatus::Exhausted("context full for seq " + std::to_string(seq_id) + ": it holds " +
                                      std::to_string(next) + " positions, " + std::to_string(n_rows) +
                                      " more exceed n_ctx_per_sequence " + std::to_string(n_ctx_per_sequence));
    }
    return ShardStatus::Ok();
}

ShardStatus validate_forward(const ForwardLimits & limits, const std::vector<ForwardEntry> & entries,
                             const std::vector<int32_t> & next_positions) {
    if (entries.empty()) {
        return ShardStatus::Invalid("empty request: a Forward needs at least one entry");
    }

    std::vector<uint32_t> seq_ids;
    seq_ids.reserve(entries.size());
    size_t total_rows = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
        const ForwardEntry & e = entries[i];
        if (e.seq_id >= limits.n_seq_max || e.seq_id >= next_positions.size()) {
            return ShardStatus::Invalid(entry_name(i, e.seq_id) + ": seq_id " + std::to_string(e.seq_id) +
                                        " is out of range: this worker holds sequences 0.." +
                                        std::to_string(limits.n_seq_max - 1));
        }
        seq_ids.push_back(e.seq_id);
        total_rows += e.positions.size();
    }
    const int64_t dup = find_duplicate_seq_id(seq_ids);
    if (dup >= 0) {
        return ShardStatus::Invalid(entry_name(static_cast<size_t>(dup), seq_ids[dup]) + ": seq_id " +
                                    std::to_string(seq_ids[dup]) + " appears more than once in one request");
    }
    // Checked before the per-entry scans so an oversized request costs nothing to refuse.
    ShardStatus st = check_batch_rows(total_rows, limits.n_batch_max);
    if (!st.ok()) {
        return st;
    }

    const std::string range = range_name(limits.layer_begin, limits.layer_end);
    BoundarySchemaDesc schema = limits.boundary;
    if (schema.n_embd == 0) {
        schema.n_embd = limits.n_embd;
    }
    const size_t row_values = schema.row_values();
    for (size_t i = 0; i < entries.size(); ++i) {
        const ForwardEntry & e = entries[i];
        const std::string who = entry_name(i, e.seq_id);
        const size_t n_rows = e.positions.size();
        if (n_rows == 0) {
            return ShardStatus::Invalid(who + ": no rows (positions is empty)");
        }

        if (limits.takes_tokens) {
            if (!e.boundary.empty()) {
                return ShardStatus::Invalid(who + ": range " + range + " takes token ids, not boundary rows");
            }
            if (e.token_ids.size() != n_rows) {
                return ShardStatus::Invalid(who + ": " + std::to_string(n_rows) + " positions but " +
                                            std::to_string(e.token_ids.size()) + " token ids");
            }
            for (size_t r = 0; r < n_rows; ++r) {
                const int32_t t = e.token_ids[r];
                if (t < 0 || static_cast<uint32_t>(t) >= limits.n_vocab) {
                    return ShardStatus::Invalid(who + ": token id " + std::to_string(t) + " at row " + std::to_string(r) +
                                                " is outside [0, " + std::to_string(limits.n_vocab) + ")");
                }
            }
        } else {
            if (!e.token_ids.empty()) {
                return ShardStatus::Invalid(who + ": range " + range + " takes boundary rows, not token ids");
            }
            const size_t elem = boundary_dtype_size(e.boundary_dtype);
            const bool scaled = e.boundary_dtype == BoundaryDType::kQ8 || e.boundary_dtype == BoundaryDType::kF16S;
            if (elem == 0 && !scaled) {
                return ShardStatus::Invalid(who + ": boundary_dtype " + std::to_string(static_cast<int>(e.boundary_dtype)) +
                                            " is not supported (send DTYPE_F32, DTYPE_F16, DTYPE_Q8 or DTYPE_F16S)");
            }
            // the declared schema first: rows of another schema are refused by name, not by size
            st = check_boundary_schema(i, e.seq_id, schema, e.boundary_schema_version, e.boundary_streams);
            if (!st.ok()) {
                return st;
            }
            if (scaled) {
                const size_t expected = boundary_wire_bytes(e.boundary_dtype, n_rows, row_values);
                if (e.boundary.size() != expected) {
                    return ShardStatus::Invalid(who + ": got " + std::to_string(e.boundary.size()) + " bytes, expected " +
                                                std::to_string(expected) + " = " + std::to_string(n_rows) +
                                                (e.boundary_dtype == BoundaryDType::kQ8 ? " Q8" : " F16S") +
                                                " rows of " + std::to_string(expected / std::max<size_t>(n_rows, 1)) +
                                                " bytes");
                }
            } else {
                st = check_boundary_bytes(i, e.seq_id, e.boundary.size(), n_rows, row_values, elem);
                if (!st.ok()) {
                    return st;
                }
            }
            const size_t n_values = n_rows * row_values;
            const int64_t bad = e.boundary_dtype == BoundaryDType::kQ8 ? find_non_finite_q8(e.boundary.data(), n_rows, row_values)
                                : e.boundary_dtype == BoundaryDType::kF16S
                                    ? find_non_finite_f16s(e.boundary.data(), n_rows, row_values)
                                : e.boundary_dtype == BoundaryDType::kF32
                                    ? find_non_finite_f32(e.boundary.data(), n_values)
                                    : find_non_finite_f16(e.boundary.data(), n_values);
            if (bad >= 0) {
                return ShardStatus::Invalid(who + ": boundary value at row " + std::to_string(bad / row_values) +
                                            ", column " + std::to_string(bad % row_values) +
                                            " is not finite (NaN or Inf)");
            }
        }

        if (limits.gives_logits) {
            std::unordered_set<uint32_t> seen;
            for (uint32_t row : e.logit_rows) {
                if (row >= n_rows) {
                    return ShardStatus::Invalid(who + ": logit_rows names row " + std::to_string(row) +
                                                " but the entry has " + std::to_string(n_rows) + " rows");
                }
                if (!seen.insert(row).second) {
                    return ShardStatus::Invalid(who + ": logit_rows names row " + std::to_string(row) + " twice");
                }
            }
        }

        st = check_positions(e.seq_id, e.positions, next_positions[e.seq_id]);
        if (!st.ok()) {
            return st;
        }
        st = check_context_room(e.seq_id, next_positions[e.seq_id], n_rows, limits.n_ctx_per_sequence);
        if (!st.ok()) {
            return st;
        }
    }
    return ShardStatus::Ok();
}

bool parse_layer_range(const std::string & text, int32_t * begin, int32_t * end, std::string * error) {
    auto parse_int = [](const std::string & s, long long * out) {
        if (s.empty()) {
            return false;
        }
        errno = 0;
        char * stop = nullptr;
        const long long v = std::strtoll(s.c_str(), &stop, 10);
        if (errno != 0 || stop != s.c_str() + s.size() || v < std::numeric_limits<int32_t>::min() ||
            v > std::numeric_limits<int32_t>::max()) {
            return false;
        }
        *out = v;
        return true;
    };
    const size_t colon = text.find(':');
    if (colon == std::string::npos) {
        *error = "--layers must be BEGIN:END (END empty or -1 for the last block), got '" + text + "'";
        return false;
    }
    long long b = 0;
    long long e = -1;
    if (!parse_int(text.substr(0, colon), &b) || b < 0) {
        *error = "--layers: BEGIN must be an integer >= 0, got '" + text + "'";
        return false;
    }
    const std::string tail = text.substr(colon + 1);
    if (!tail.empty() && (!parse_int(tail, &e) || (e != -1 && e <= b))) {
        *error = "--layers: END must be empty, -1, or an integer > BEGIN, got '" + text + "'";
        return false;
    }
    *begin = static_cast<int32_t>(b);
    *end = static_cast<int32_t>(e);
    return true;
}

}  // namespace baton
