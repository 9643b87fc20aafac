// serve_worker() (service.h): the worker process's life. Loads the shard, binds the gRPC Unix
// socket (a stale file removed, mode 0600), starts the Forward stream and the data plane when
// asked, turns SIGTERM/SIGINT (and the parent's death) into a clean shutdown, and removes the
// socket file at exit. Split from service.cpp, which translates RPCs: this owns the process's
// sockets and signals, not any request.
#include "service.h"

#include "data_plane.h"
#include "forward_stream.h"
#include "sealed.h"

#include <algorithm>
#include <csignal>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

namespace baton {

namespace {

// How long in-flight calls may take to finish once SIGTERM/SIGINT arrives.
constexpr std::chrono::seconds kShutdownGrace{5};

// SIGTERM/SIGINT handled on a thread of its own through sigwait (a signal handler may not
// call Server::Shutdown). The first signal cancels a load in progress or shuts the server
// down; a second one removes the socket file and exits at once.
//
// With parent_pid > 0, SIGHUP is the parent-death signal (PR_SET_PDEATHSIG, armed in main):
// it counts as a stop signal once getppid() is no longer parent_pid, and is ignored while it
// still is (the thread that forked us exited; the parent process lives on).
class SignalWatcher {
public:
    SignalWatcher(std::string socket_path, int parent_pid)
        : socket_path_(std::move(socket_path)), parent_pid_(parent_pid) {
        sigemptyset(&signals_);
        sigaddset(&signals_, SIGINT);
        sigaddset(&signals_, SIGTERM);
        if (parent_pid_ > 0) {
            sigaddset(&signals_, SIGHUP);
        }
        pthread_sigmask(SIG_BLOCK, &signals_, &old_mask_);
        thread_ = std::thread([this] { run(); });
    }

    ~SignalWatcher() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            exiting_ = true;
        }
        pthread_kill(thread_.native_handle(), SIGTERM);  // wakes sigwait; seen as "exiting"
        thread_.join();
        pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    }

    SignalWatcher(const SignalWatcher &) = delete;
    SignalWatcher & operator=(const SignalWatcher &) = delete;

    const std::atomic<bool> * stop_flag() const { return &stop_; }
    bool stop_requested() const { return stop_.load(); }

    // Shut this server down on the next signal (or now, if one already came).
    void attach(grpc::Server * server) {
        std::lock_guard<std::mutex> lock(mu_);
        server_ = server;
        if (stop_.load()) {
            shutdown_locked();
        }
    }

    void detach() {
        std::lock_guard<std::mutex> lock(mu_);
        server_ = nullptr;
    }

private:
    void run() {
        for (;;) {
            int sig = 0;
            if (sigwait(&signals_, &sig) != 0) {
                continue;
            }
            std::lock_guard<std::mutex> lock(mu_);
            if (exiting_) {
                return;
            }
            if (sig == SIGHUP) {
                if (parent_pid_ <= 0 || static_cast<int>(::getppid()) == parent_pid_) {
                    continue;
                }
                if (!stop_.load()) {
                    std::fprintf(stderr, "baton-worker: parent process %d exited, stopping\n", parent_pid_);
                }
            }
            if (stop_.exchange(true)) {
                std::fprintf(stderr, "baton-worker: second signal %d, exiting now\n", sig);
                if (server_ != nullptr) {
                    ::unlink(socket_path_.c_str());
                }
                std::_Exit(1);
            }
            if (server_ != nullptr) {
                shutdown_locked();
            }
        }
    }

    void shutdown_locked() {
        server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
    }

    std::string socket_path_;
    int parent_pid_ = 0;
    sigset_t signals_{};
    sigset_t old_mask_{};
    std::thread thread_;
    std::mutex mu_;
    std::atomic<bool> stop_{false};
    bool exiting_ = false;
    grpc::Server * server_ = nullptr;
};


std::string one_line(std::string text) {
    for (char & c : text) {
        if (c == '\n' || c == '\r') {
            c = ' ';
        }
    }
    return text;
}

}  // namespace

std::string free_socket_path(const std::string & path) {
    sockaddr_un addr{};
    if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
        return "socket path must be 1.." + std::to_string(sizeof(addr.sun_path) - 1) + " bytes, got " +
               std::to_string(path.size());
    }
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
        if (errno == ENOENT) {
            return "";
        }
        return "cannot stat " + path + ": " + std::strerror(errno);
    }
    if (!S_ISSOCK(st.st_mode)) {
        return path + " exists and is not a socket; not replacing it";
    }
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        const bool live = ::connect(fd, reinterpret_cast<const sockaddr *>(&addr), sizeof(addr)) == 0;
        ::close(fd);
        if (live) {
            return "socket " + path + " is in use by a running process";
        }
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
        return "cannot remove stale socket " + path + ": " + std::strerror(errno);
    }
    return "";
}

int serve_worker(const WorkerOptions & options) {
    SignalWatcher signals(options.socket_path, options.parent_pid);

    ShardConfig config = options.shard;
    config.cancel_load = signals.stop_flag();
    std::unique_ptr<Shard> shard;
    try {
        shard = std::make_unique<Shard>(config);
    } catch (const std::exception & e) {
        if (signals.stop_requested()) {
            std::fprintf(stderr, "baton-worker: stopped while loading\n");
            return 1;
        }
        std::fprintf(stderr, "baton-worker: %s\n", one_line(e.what()).c_str());
        return 1;
    }
    if (signals.stop_requested()) {
        std::fprintf(stderr, "baton-worker: stopped while loading\n");
        return 1;
    }

    const std::string reason = free_socket_path(options.socket_path);
    if (!reason.empty()) {
        std::fprintf(stderr, "baton-worker: %s\n", one_line(reason).c_str());
        return 1;
    }

    EngineConfig engine_config;
    engine_config.prefill_pace_max = std::chrono::milliseconds(options.prefill_pace_ms);
    engine_config.decoding_lapse = default_decoding_lapse(engine_config.prefill_pace_max);
    ShardWorkerService service(shard.get(), engine_config);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + options.socket_path, grpc::InsecureServerCredentials());
    builder.SetMaxReceiveMessageSize(max_receive_message_bytes(shard->info()));
    builder.SetMaxSendMessageSize(max_send_message_bytes(shard->info()));
    builder.RegisterService(&service);

    // The socket is created 0600 (umask) and chmod-ed again in case the umask was ignored.
    const mode_t old_umask = ::umask(0177);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ::umask(old_umask);
    if (!server) {
        std::fprintf(stderr, "baton-worker: cannot listen on unix:%s\n", options.socket_path.c_str());
        return 1;
    }
    if (::chmod(options.socket_path.c_str(), 0600) != 0) {
        std::fprintf(stderr, "baton-worker: cannot chmod 0600 %s: %s\n", options.socket_path.c_str(),
                     std::strerror(errno));
        server->Shutdown();
        ::unlink(options.socket_path.c_str());
        return 1;
    }

    const ShardInfo & info = shard->info();
    if (info.vocab_only) {
        std::fprintf(stderr, "baton-worker: serving the vocabulary of %s (%u tokens, --vocab-only) on unix:%s\n",
                     info.architecture.c_str(), info.n_vocab, options.socket_path.c_str());
    } else {
        std::fprintf(stderr, "baton-worker: serving %s layers [%u,%u) of %u on unix:%s (backend %s)\n",
                     info.architecture.c_str(), info.layer_begin, info.layer_end, info.n_layer,
                     options.socket_path.c_str(), info.backend.c_str());
    }

    ForwardStreamServer stream(&service, static_cast<size_t>(max_receive_message_bytes(info)));
    if (!options.forward_socket_path.empty()) {
        const std::string failed = stream.start(options.forward_socket_path);
        if (!failed.empty()) {
            std::fprintf(stderr, "baton-worker: forward stream: %s\n", one_line(failed).c_str());
            server->Shutdown();
            ::unlink(options.socket_path.c_str());
            return 1;
        }
    }

    DataPlaneLimits limits;
    limits.max_frame_bytes = static_cast<size_t>(max_receive_message_bytes(info)) + 4096;
    limits.unproven_timeout = std::chrono::milliseconds(options.data_unproven_timeout_ms);
    limits.max_connections = options.data_max_connections;
    DataPlaneServer data_plane(&service, limits);
    if (!options.data_host.empty()) {
        const std::string failed = info.vocab_only ? "a vocab-only worker has no data plane"
                                                   : data_plane.start(options.data_host, options.data_port);
        if (!failed.empty()) {
            std::fprintf(stderr, "baton-worker: data plane: %s\n", one_line(failed).c_str());
            stream.stop();
            server->Shutdown();
            ::unlink(options.socket_path.c_str());
            return 1;
        }
        service.set_data_plane(&data_plane);
        std::fprintf(stderr, "baton-worker: data plane on %s port %u\n", options.data_host.c_str(),
                     static_cast<unsigned>(data_plane.port()));
    }

    signals.attach(server.get());
    server->Wait();
    signals.detach();
    data_plane.stop();  // a step being computed finishes first
    stream.stop();  // a Forward in progress on it finishes first
    server.reset();
    ::unlink(options.socket_path.c_str());
    return 0;
}

}  // namespace baton
