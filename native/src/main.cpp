// baton-worker: parses the command line (kUsage below, printed by --help) and calls
// serve_worker(). Exit codes: 0 after a clean shutdown, 1 when the model cannot be loaded or
// the socket cannot be bound (or, on Linux, the parent had already exited), 2 on bad
// arguments. Errors are one line on stderr. On Linux it stops (as on SIGTERM) when the
// process that started it exits.
#include "data_plane.h"
#include "service.h"
#include "sha256.h"
#include "shard.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#ifdef __linux__
#include <csignal>
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>
#endif

namespace {

constexpr const char * kUsage =
    "usage: baton-worker --model PATH --layers BEGIN:END --socket PATH [--forward-socket PATH]\n"
    "                    [--data-listen HOST:PORT] [--prefill-pace-ms N]\n"
    "                    [--data-unproven-timeout-ms N] [--data-max-connections N]\n"
    "                    [--ctx-size N] [--max-sequences N] [--prefix-cache-bytes N]\n"
    "                    [--batch-size N] [--threads N] [--threads-decode N] [--gpu-layers N]\n"
    "                    [--model-sha256 HEX] [--no-mmap] [--top-k-in-graph auto|on|off]\n"
    "       baton-worker --vocab-only --model PATH --socket PATH [--model-sha256 HEX] [--no-mmap]\n"
    "  --layers B:E      blocks [B, E) in global numbering; E empty or -1: to the last block\n"
    "  --vocab-only      load only the vocabulary (no tensor is read: a metadata-only sparse GGUF\n"
    "                    serves): Info, Health, Tokenize, Detokenize, Vocabulary; no --layers; the\n"
    "                    context flags have no effect; the file is not hashed (Info reports the\n"
    "                    --model-sha256 given, else no sha256)\n"
    "  --socket PATH     listen on unix:PATH only (mode 0600; a stale socket file is replaced)\n"
    "  --forward-socket PATH  also serve Forward as a stream of length-prefixed frames on the Unix\n"
    "                    socket PATH (protocol/worker.proto, ForwardStreamReply; mode 0600)\n"
    "  --data-listen HOST:PORT  serve the data plane on TCP HOST:PORT (port 0: any free one; Info\n"
    "                    reports it): sessions bound by the node take sealed steps straight from\n"
    "                    the hop before (protocol/worker.proto, DataFrame); off unless given\n"
    "  --prefill-pace-ms N  while sessions decode on the data plane, a prompt chunk (a prefill\n"
    "                    Forward or a data-plane step of more than one row) waits up to N ms for\n"
    "                    the next decode Forward, so that chunks and decode steps take turns\n"
    "                    (default 1000; 0: no pacing)\n"
    "  --data-unproven-timeout-ms N  a data-plane connection that has sent no frame of a session\n"
    "                    bound here (sealed with its key) is closed after N ms (default 30000)\n"
    "  --data-max-connections N  data-plane connections, accepted and dialled (default 256); when\n"
    "                    all are taken, a new one replaces the oldest unproven accepted one\n"
    "  --ctx-size N      positions per sequence (default 2048)\n"
    "  --max-sequences N sequence ids 0..N-1 (default 4)\n"
    "  --prefix-cache-bytes N  keep ended sessions' prompt prefixes (whole blocks, by the hashes\n"
    "                    their owner sent) in spare sequences of at most N bytes of KV in all,\n"
    "                    least recently used first out; a new session copies its longest one\n"
    "                    (PrefixLookup, OpenPrefix; default 0 = off)\n"
    "  --batch-size N    most rows one Forward may carry (default 512)\n"
    "  --threads N       CPU threads, 0 = all cores (default 0)\n"
    "  --threads-decode N  CPU threads of a Forward whose micro-batch is one row (a lone session's\n"
    "                    decode step; llama.cpp's n_threads, where --threads is n_threads_batch);\n"
    "                    0 = --threads (default 0). The numbers do not change with it\n"
    "  --gpu-layers N    blocks to offload (llama.cpp n_gpu_layers; default -1 = all)\n"
    "  --model-sha256 H  the model's sha256 (skips hashing the file at start)\n"
    "  --no-mmap         read the model into memory instead of mapping it\n"
    "  --top-k-in-graph M  where the last range selects a Forward's top-K and log-sum-exp: on =\n"
    "                    in llama.cpp's graph (only K values a row leave the device), off = on\n"
    "                    the host from the full rows, auto = in the graph when layers are\n"
    "                    offloaded to a non-CPU backend (default auto)\n"
    "  --rollback-positions N  keep N positions of rollback snapshots per sequence (llama.cpp\n"
    "                    n_rs_seq; models whose state cannot be cut back, e.g. DeepSeek V4's\n"
    "                    compressor state, can then be trimmed by at most N positions; default 0)\n"
    "  --version         print the runtime this binary was built with (JSON) and exit\n"
    "  env BATON_LLAMA_LOG=1 passes llama.cpp's log through to stderr\n";

[[noreturn]] void bad_arguments(const std::string & message) {
    std::fprintf(stderr, "baton-worker: %s (see --help)\n", message.c_str());
    std::exit(2);
}

long long parse_integer(const std::string & flag, const std::string & text, long long min, long long max) {
    errno = 0;
    char * stop = nullptr;
    const long long v = text.empty() ? 0 : std::strtoll(text.c_str(), &stop, 10);
    if (text.empty() || errno != 0 || stop != text.c_str() + text.size() || v < min || v > max) {
        bad_arguments(flag + " must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                      "], got '" + text + "'");
    }
    return v;
}

}  // namespace

int main(int argc, char ** argv) {
#ifdef __linux__
    // A worker must not outlive the node agent that started it (a SIGKILLed agent cannot stop
    // it). PR_SET_PDEATHSIG fires when the *thread* that forked us exits, not the process
    // (trio forks from a cached thread that retires after 10 s idle), so the signal is SIGHUP,
    // blocked here and handled by serve_worker's signal thread: a stop only once getppid() is
    // no longer the agent (the kernel re-parents us before it signals, and re-arms for the
    // next thread). Parent = BATON_WORKER_PARENT_PID when the agent sets it, so that an agent
    // that died before prctl() is noticed too.
    pid_t parent = getppid();
    if (const char * env = std::getenv("BATON_WORKER_PARENT_PID"); env != nullptr && *env != '\0') {
        char * stop = nullptr;
        const long long pid = std::strtoll(env, &stop, 10);
        if (stop != nullptr && *stop == '\0' && pid > 0 && pid <= std::numeric_limits<pid_t>::max()) {
            parent = static_cast<pid_t>(pid);
        }
    }
    {
        sigset_t hup;
        sigemptyset(&hup);
        sigaddset(&hup, SIGHUP);
        pthread_sigmask(SIG_BLOCK, &hup, nullptr);  // inherited by every thread started later
        if (prctl(PR_SET_PDEATHSIG, SIGHUP) != 0) {
            std::perror("baton-worker: prctl(PR_SET_PDEATHSIG)");
        }
        if (getppid() != parent) {
            std::fprintf(stderr, "baton-worker: parent process %d exited before the worker started\n",
                         static_cast<int>(parent));
            return 1;
        }
    }
#endif
    baton::WorkerOptions options;
    baton::ShardConfig & shard = options.shard;
    shard.ctx_size_per_seq = 2048;
    shard.max_sequences = 4;
    shard.batch_size = 512;
    shard.threads = 0;
    shard.gpu_layers = -1;
    bool have_layers = false;
    bool vocab_only = false;

    constexpr long long kU32Max = std::numeric_limits<uint32_t>::max();
    constexpr long long kI32Max = std::numeric_limits<int32_t>::max();
    for (int i = 1; i < argc; ++i) {
        std::string flag = argv[i];
        std::string value;
        bool inline_value = false;
        const size_t eq = flag.find('=');
        if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
            value = flag.substr(eq + 1);
            flag = flag.substr(0, eq);
            inline_value = true;
        }
        auto take_value = [&]() -> std::string {
            if (inline_value) {
                return value;
            }
            if (i + 1 >= argc) {
                bad_arguments(flag + " needs a value");
            }
            return argv[++i];
        };

        if (flag == "-h" || flag == "--help") {
            std::fputs(kUsage, stdout);
            return 0;
        } else if (flag == "--version") {
            std::fputs(baton::runtime_version_json().c_str(), stdout);
            return 0;
        } else if (flag == "--model") {
            shard.model_path = take_value();
        } else if (flag == "--layers") {
            std::string error;
            if (!baton::parse_layer_range(take_value(), &shard.layer_begin, &shard.layer_end, &error)) {
                bad_arguments(error);
            }
            have_layers = true;
        } else if (flag == "--socket") {
            options.socket_path = take_value();
        } else if (flag == "--forward-socket") {
            options.forward_socket_path = take_value();
        } else if (flag == "--data-listen") {
            std::string error;
            if (!baton::parse_host_port(take_value(), &options.data_host, &options.data_port, &error)) {
                bad_arguments("--data-listen: " + error);
            }
        } else if (flag == "--prefill-pace-ms") {
            options.prefill_pace_ms = static_cast<uint32_t>(parse_integer(flag, take_value(), 0, 600000));
        } else if (flag == "--data-unproven-timeout-ms") {
            options.data_unproven_timeout_ms = static_cast<uint32_t>(parse_integer(flag, take_value(), 1, 3600000));
        } else if (flag == "--data-max-connections") {
            options.data_max_connections = static_cast<uint32_t>(parse_integer(flag, take_value(), 2, 65536));
        } else if (flag == "--ctx-size") {
            shard.ctx_size_per_seq = static_cast<uint32_t>(parse_integer(flag, take_value(), 1, kI32Max));
        } else if (flag == "--max-sequences") {
            shard.max_sequences = static_cast<uint32_t>(
                parse_integer(flag, take_value(), 1, static_cast<long long>(baton::max_sequences_limit())));
        } else if (flag == "--prefix-cache-bytes") {
            shard.prefix_cache_bytes = static_cast<uint64_t>(parse_integer(flag, take_value(), 0, std::numeric_limits<long long>::max()));
        } else if (flag == "--rollback-positions") {
            shard.rollback_positions = static_cast<uint32_t>(parse_integer(flag, take_value(), 0, 64));
        } else if (flag == "--batch-size") {
            shard.batch_size = static_cast<uint32_t>(parse_integer(flag, take_value(), 1, kI32Max));
        } else if (flag == "--threads") {
            shard.threads = static_cast<int32_t>(parse_integer(flag, take_value(), 0, 4096));
        } else if (flag == "--threads-decode") {
            shard.threads_decode = static_cast<int32_t>(parse_integer(flag, take_value(), 0, 4096));
        } else if (flag == "--gpu-layers") {
            shard.gpu_layers = static_cast<int32_t>(parse_integer(flag, take_value(), -1, kI32Max));
        } else if (flag == "--top-k-in-graph") {
            if (!baton::parse_top_k_in_graph(take_value(), &shard.top_k_in_graph)) {
                bad_arguments("--top-k-in-graph must be auto, on or off");
            }
        } else if (flag == "--model-sha256") {
            shard.model_sha256 = take_value();
            if (!baton::is_sha256_hex(shard.model_sha256)) {
                bad_arguments("--model-sha256 must be 64 hex digits");
            }
        } else if (flag == "--no-mmap" && !inline_value) {
            shard.use_mmap = false;
        } else if (flag == "--vocab-only" && !inline_value) {
            vocab_only = true;
        } else {
            bad_arguments("unknown argument '" + std::string(argv[i]) + "'");
        }
    }

    if (shard.model_path.empty()) {
        bad_arguments("--model is required");
    }
    if (vocab_only && have_layers) {
        bad_arguments("--layers cannot be given with --vocab-only (a vocab-only worker holds no blocks)");
    }
    if (!have_layers && !vocab_only) {
        bad_arguments("--layers is required (unless --vocab-only)");
    }
    shard.vocab_only = vocab_only;
    if (options.socket_path.empty()) {
        bad_arguments("--socket is required");
    }
    if (static_cast<uint64_t>(shard.ctx_size_per_seq) * shard.max_sequences > static_cast<uint64_t>(kU32Max)) {
        bad_arguments("--ctx-size x --max-sequences is too large");
    }
#ifdef __linux__
    options.parent_pid = parent;
#endif
    return baton::serve_worker(options);
}
