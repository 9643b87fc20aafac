// baton-shard-bench: one Shard (the worker's model code, no gRPC, no Python) decoding after a
// prompt, as llama-bench decodes: separates what the KV configuration costs from what the
// service, the gRPC hop and the client cost (bench/README.md, "worker against llama-bench").
//
// usage: baton-shard-bench MODEL [--ctx-size N] [--max-sequences N] [--prompt N] [--steps N]
//                          [--reps N] [--threads N] [--top-k K] [--gap-us N] [--begin B] [--end E]
//                          [--parallel N] [--split K] [--gap-spin 0|1] [--top-k-in-graph auto|on|off]
// --begin/--end: the block range [B, E) (default the whole model); a range that does not take
// tokens gets boundary rows in (small deterministic values, f32), as a served range does.
// --gap-us N: sleep N us before each decode step (not timed): the idle gap a served worker
// has between two requests. --gap-spin 1: spend the gap spinning on the clock instead (the
// core never idles), which tells an idle core's wake-up from whatever else the gap costs.
// --parallel N: N sequences (--max-sequences is raised to N when lower), each with its own
// prompt Forward, then every decode Forward carries one row of each: llama-batched-bench's
// -npl N, with the worker's per-row work (top-K, log-sum-exp) included.
// --top-k-in-graph: where the last range selects its top-K (ShardConfig::top_k_in_graph; default
// auto, as the worker): on and off time the in-graph selection against the host path.
// --split K: the whole model and K ranges of an even split (cut at round(i * n_layer / K)), in
// this one process, decoding the same tokens step by step in turn: each step the whole model's
// Forward, then the ranges' Forwards in series, each range given the one before's boundary
// rows (the last range's top-K compared with the whole model's). Timing the two step by step
// cancels the machine's drift, which between two runs is larger than the difference: what
// cutting the model costs with no process, socket or Python between the ranges.
// Prints one JSON line: per rep, the prompt Forwards' and the mean decode Forward's wall ms
// and the process CPU ms per decode step (getrusage), with the configuration.
#include "shard.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

double cpu_s() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --split: see the header. Returns the process exit code.
int run_split(baton::ShardConfig config, int parts, int prompt, int steps, int reps, uint32_t top_k) {
    baton::Shard whole(config);
    const int32_t n_layer = static_cast<int32_t>(whole.info().n_layer);
    if (parts < 2 || parts > n_layer) {
        std::fprintf(stderr, "--split must be in [2, %d]\n", n_layer);
        return 2;
    }
    std::vector<std::unique_ptr<baton::Shard>> ranges;
    std::string ranges_json;  // [[begin, end], ...]: reported, so a caller need not cut again
    for (int i = 0; i < parts; ++i) {
        baton::ShardConfig part = config;
        part.layer_begin = static_cast<int32_t>(std::lround(static_cast<double>(i) * n_layer / parts));
        part.layer_end = static_cast<int32_t>(std::lround(static_cast<double>(i + 1) * n_layer / parts));
        ranges.push_back(std::make_unique<baton::Shard>(part));
        ranges_json += (i ? ", [" : "[") + std::to_string(part.layer_begin) + ", " + std::to_string(part.layer_end) + "]";
    }
    // One step through the ranges in series: tokens into the first, each range's boundary rows
    // into the next; the last range's output in *last.
    auto chain = [&](const std::vector<int32_t> & positions, const std::vector<int32_t> & tokens,
                     baton::ForwardOutput * last) -> baton::ShardStatus {
        std::string carried;
        for (size_t r = 0; r < ranges.size(); ++r) {
            baton::ForwardEntry e;
            e.positions = positions;
            if (r == 0) {
                e.token_ids = tokens;
            } else {
                e.boundary = carried;
                e.boundary_dtype = baton::BoundaryDType::kF32;
            }
            e.top_k = top_k;
            std::vector<baton::ForwardOutput> out;
            const baton::ShardStatus st = ranges[r]->forward({e}, &out);
            if (!st.ok()) {
                return st;
            }
            carried = std::move(out[0].boundary);
            *last = std::move(out[0]);
        }
        return {};
    };
    std::string runs;
    bool equal = true;
    for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
        std::vector<int32_t> positions, tokens;
        for (int p = 0; p < prompt; ++p) {
            positions.push_back(p);
            tokens.push_back(100 + p);
        }
        baton::ForwardEntry e;
        e.positions = positions;
        e.token_ids = tokens;
        e.top_k = top_k;
        std::vector<baton::ForwardOutput> out;
        baton::ForwardOutput last;
        baton::ShardStatus st = whole.forward({e}, &out);
        if (st.ok()) st = chain(positions, tokens, &last);
        double whole_s = 0, split_s = 0;
        std::vector<double> differences_ms;
        for (int s = 0; s < steps && st.ok(); ++s) {
            const std::vector<int32_t> step_positions = {prompt + s}, step_tokens = {200 + s};
            baton::ForwardEntry d;
            d.positions = step_positions;
            d.token_ids = step_tokens;
            d.top_k = top_k;
            double t0 = now_s();
            st = whole.forward({d}, &out);
            const double w = now_s() - t0;
            if (!st.ok()) break;
            t0 = now_s();
            st = chain(step_positions, step_tokens, &last);
            const double c = now_s() - t0;
            whole_s += w;
            split_s += c;
            differences_ms.push_back(1e3 * (c - w));
            equal = equal && last.top_token_ids == out[0].top_token_ids && last.top_logits == out[0].top_logits;
        }
        if (!st.ok()) {
            std::fprintf(stderr, "forward failed: %s\n", st.message.c_str());
            return 1;
        }
        int32_t next = 0;
        whole.remove_sequence(0, &next);
        for (auto & range : ranges) range->remove_sequence(0, &next);
        if (rep > 0) {
            std::sort(differences_ms.begin(), differences_ms.end());
            char buf[200];
            std::snprintf(buf, sizeof(buf),
                          "%s{\"whole_decode_ms\": %.3f, \"split_decode_ms\": %.3f, \"difference_ms_median\": %.3f}",
                          runs.empty() ? "" : ", ", 1e3 * whole_s / steps, 1e3 * split_s / steps,
                          differences_ms[differences_ms.size() / 2]);
            runs += buf;
        }
    }
    std::printf("{\"split\": %d, \"n_layer\": %d, \"ranges\": [%s], \"prompt\": %d, \"steps\": %d, \"threads\": %d, "
                "\"top_k\": %u, \"top_k_equal\": %s, \"runs\": [%s]}\n",
                parts, n_layer, ranges_json.c_str(), prompt, steps, config.threads, top_k, equal ? "true" : "false",
                runs.c_str());
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: baton-shard-bench MODEL [--ctx-size N] [--max-sequences N] [--prompt N] "
                             "[--steps N] [--reps N] [--threads N] [--top-k K] [--gap-us N] [--begin B] [--end E] "
                             "[--parallel N] [--split K] [--top-k-in-graph auto|on|off]\n");
        return 2;
    }
    baton::ShardConfig config;
    config.model_path = argv[1];
    config.layer_begin = 0;
    config.layer_end = -1;
    config.ctx_size_per_seq = 2048;  // the worker's defaults (native/src/main.cpp)
    config.max_sequences = 4;
    config.batch_size = 512;
    config.threads = 1;
    int prompt = 64, steps = 32, reps = 3, parallel = 1, split = 0;
    long gap_us = 0;  // idle time between decode steps (not timed), as a served worker has
    bool gap_spin = false;
    uint32_t top_k = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        if (flag == "--top-k-in-graph") {
            if (!baton::parse_top_k_in_graph(argv[i + 1], &config.top_k_in_graph)) {
                std::fprintf(stderr, "--top-k-in-graph must be auto, on or off\n");
                return 2;
            }
            continue;
        }
        const long v = std::strtol(argv[i + 1], nullptr, 10);
        if (flag == "--ctx-size") config.ctx_size_per_seq = static_cast<uint32_t>(v);
        else if (flag == "--max-sequences") config.max_sequences = static_cast<uint32_t>(v);
        else if (flag == "--prompt") prompt = static_cast<int>(v);
        else if (flag == "--steps") steps = static_cast<int>(v);
        else if (flag == "--reps") reps = static_cast<int>(v);
        else if (flag == "--threads") config.threads = static_cast<int32_t>(v);
        else if (flag == "--top-k") top_k = static_cast<uint32_t>(v);
        else if (flag == "--gap-us") gap_us = v;
        else if (flag == "--gap-spin") gap_spin = v != 0;
        else if (flag == "--begin") config.layer_begin = static_cast<int32_t>(v);
        else if (flag == "--end") config.layer_end = static_cast<int32_t>(v);
        else if (flag == "--parallel") parallel = static_cast<int>(v);
        else if (flag == "--split") split = static_cast<int>(v);
        else {
            std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
            return 2;
        }
    }
    if (parallel < 1) {
        std::fprintf(stderr, "--parallel must be at least 1\n");
        return 2;
    }
    if (config.max_sequences < static_cast<uint32_t>(parallel)) {
        config.max_sequences = static_cast<uint32_t>(parallel);
    }
    try {
        if (split != 0) {
            if (top_k == 0 || parallel != 1 || gap_us != 0 || config.layer_begin != 0 || config.layer_end != -1) {
                std::fprintf(stderr, "--split takes --top-k K > 0 and none of --parallel, --gap-us, --begin, --end\n");
                return 2;
            }
            return run_split(config, split, prompt, steps, reps, top_k);
        }
        baton::Shard shard(config);
        const bool takes_tokens = shard.info().takes_tokens;
        const size_t row_values = shard.info().boundary.row_values();
        std::vector<float> rows(static_cast<size_t>(prompt) * row_values);
        for (size_t i = 0; i < rows.size(); ++i) {
            rows[i] = 0.01f * static_cast<float>((i * 2654435761u) % 200) - 1.0f;
        }
        const std::string_view prompt_rows(reinterpret_cast<const char *>(rows.data()), rows.size() * sizeof(float));
        const std::string_view step_rows(reinterpret_cast<const char *>(rows.data()), row_values * sizeof(float));
        std::string runs;
        for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
            std::vector<baton::ForwardOutput> out;
            baton::ShardStatus st;
            double t0 = now_s();
            for (int q = 0; q < parallel && st.ok(); ++q) {  // one prompt Forward per sequence
                baton::ForwardEntry e;
                e.seq_id = static_cast<uint32_t>(q);
                for (int p = 0; p < prompt; ++p) {
                    e.positions.push_back(p);
                    if (takes_tokens) e.token_ids.push_back(100 + p + q);
                }
                if (!takes_tokens) {
                    e.boundary = prompt_rows;
                    e.boundary_dtype = baton::BoundaryDType::kF32;
                }
                st = shard.forward({e}, &out);
            }
            const double prompt_ms = 1e3 * (now_s() - t0);
            double decode_s = 0, decode_cpu_s = 0;
            for (int s = 0; s < steps && st.ok(); ++s) {
                std::vector<baton::ForwardEntry> batch(static_cast<size_t>(parallel));
                for (int q = 0; q < parallel; ++q) {
                    baton::ForwardEntry & d = batch[static_cast<size_t>(q)];
                    d.seq_id = static_cast<uint32_t>(q);
                    d.positions = {prompt + s};
                    if (takes_tokens) {
                        d.token_ids = {200 + s + q};
                    } else {
                        d.boundary = step_rows;
                        d.boundary_dtype = baton::BoundaryDType::kF32;
                    }
                    d.top_k = top_k;
                }
                if (gap_us > 0 && gap_spin) {
                    const double until = now_s() + 1e-6 * static_cast<double>(gap_us);
                    while (now_s() < until) {
                    }
                } else if (gap_us > 0) {
                    usleep(static_cast<useconds_t>(gap_us));
                }
                const double c0 = cpu_s();
                t0 = now_s();
                st = shard.forward(batch, &out);
                decode_s += now_s() - t0;
                decode_cpu_s += cpu_s() - c0;
            }
            const double decode_ms = 1e3 * decode_s / steps;
            const double cpu_ms = 1e3 * decode_cpu_s / steps;
            if (!st.ok()) {
                std::fprintf(stderr, "forward failed: %s\n", st.message.c_str());
                return 1;
            }
            for (int q = 0; q < parallel; ++q) {
                int32_t next = 0;
                shard.remove_sequence(static_cast<uint32_t>(q), &next);
            }
            if (rep > 0) {
                char buf[160];
                std::snprintf(buf, sizeof(buf), "%s{\"prompt_ms\": %.3f, \"decode_ms\": %.3f, \"decode_cpu_ms\": %.3f}",
                              runs.empty() ? "" : ", ", prompt_ms, decode_ms, cpu_ms);
                runs += buf;
            }
        }
        std::printf("{\"ctx_size\": %u, \"max_sequences\": %u, \"prompt\": %d, \"steps\": %d, \"threads\": %d, "
                    "\"top_k\": %u, \"parallel\": %d, \"runs\": [%s]}\n",
                    config.ctx_size_per_seq, config.max_sequences, prompt, steps, config.threads, top_k, parallel,
                    runs.c_str());
    } catch (const std::exception & ex) {
        std::fprintf(stderr, "baton-shard-bench: %s\n", ex.what());
        return 1;
    }
    return 0;
}
