// baton-handoff-bench: what the engine's hand-off costs (native/src/engine.h): one Engine over a
// small Shard (the model's first block), and a caller that posts a job that does nothing and
// waits for its answer, after an idle gap. A gRPC Forward or sequence call pays this twice (a
// wake-up of the engine thread, and one of the caller); a data-plane step once (the engine's).
//
// usage: baton-handoff-bench MODEL [--calls N] [--gaps-us 0,100,1000,5000]
// --gaps-us: the caller sleeps this long before each call (not timed), so both threads sleep
// before it, as a served worker's do between a lone session's steps.
// Prints one JSON line per gap: the calls' wall us (median, p90) and the process's CPU us per
// call (getrusage).
#include "engine.h"
#include "shard.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::vector<long> parse_list(const std::string & text) {
    std::vector<long> values;
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) {
        values.push_back(std::strtol(item.c_str(), nullptr, 10));
    }
    return values;
}

double cpu_us() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return (usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1e6 + usage.ru_utime.tv_usec + usage.ru_stime.tv_usec;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: baton-handoff-bench MODEL [--calls N] [--gaps-us A,B,..]\n");
        return 2;
    }
    baton::ShardConfig config;
    config.model_path = argv[1];
    config.layer_begin = 0;
    config.layer_end = 1;
    config.ctx_size_per_seq = 64;
    config.max_sequences = 1;
    config.threads = 1;
    int calls = 400;
    std::vector<long> gaps{0, 100, 1000, 5000};
    for (int i = 2; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        if (flag == "--calls") calls = std::atoi(argv[i + 1]);
        else if (flag == "--gaps-us") gaps = parse_list(argv[i + 1]);
        else {
            std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
            return 2;
        }
    }
    baton::Shard shard(config);
    const auto nothing = [](baton::Shard &) { return baton::ShardStatus::Ok(); };
    {
        baton::Engine engine(&shard, baton::EngineConfig{});
        for (long gap : gaps) {
            std::vector<double> wall_us;
            wall_us.reserve(calls);
            const double cpu_before = cpu_us();
            for (int c = 0; c < calls; ++c) {
                if (gap > 0) {
                    std::this_thread::sleep_for(std::chrono::microseconds(gap));
                }
                const auto started = std::chrono::steady_clock::now();
                engine.call(baton::QueuedKind::kOperation, 0, nothing);
                wall_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count());
            }
            const double cpu_per_call = (cpu_us() - cpu_before) / calls;
            std::sort(wall_us.begin(), wall_us.end());
            std::printf("{\"gap_us\": %ld, \"calls\": %d, \"median_us\": %.1f, \"p90_us\": %.1f, "
                        "\"cpu_us_per_call\": %.1f}\n",
                        gap, calls, wall_us[wall_us.size() / 2], wall_us[wall_us.size() * 9 / 10], cpu_per_call);
            std::fflush(stdout);
        }
    }
    return 0;
}
