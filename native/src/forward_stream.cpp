// ForwardStreamServer: see forward_stream.h.
#include "forward_stream.h"

#include "fd_io.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <unordered_set>
#include <utility>

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

namespace baton {

namespace v1 = baton::worker::v1;

namespace {

constexpr size_t kPrefixBytes = 4;  // little-endian u32 length

uint32_t read_le32(const unsigned char * p) {
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
           static_cast<uint32_t>(p[3]) << 24;
}

// The reply frame: prefix + the serialized reply, in one buffer so that it is one send().
bool send_reply(int fd, const v1::ForwardStreamReply & reply) {
    const size_t size = reply.ByteSizeLong();
    std::string frame(kPrefixBytes + size, '\0');
    for (size_t i = 0; i < kPrefixBytes; ++i) {
        frame[i] = static_cast<char>((size >> (8 * i)) & 0xff);
    }
    if (!reply.SerializeToArray(frame.data() + kPrefixBytes, static_cast<int>(size))) {
        return false;
    }
    return write_full(fd, frame.data(), frame.size());
}

v1::ForwardStreamReply error_reply(grpc::StatusCode code, std::string message) {
    v1::ForwardStreamReply reply;
    reply.set_schema_version(v1::SCHEMA_VERSION_CURRENT);
    reply.set_code(static_cast<uint32_t>(code));
    reply.set_message(std::move(message));
    return reply;
}

// Whether the caller has sent another frame (or closed, or the socket failed): a run-ahead
// stops at once for it.
bool frame_waiting(int fd) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) != 0;
}

// The greedy token of a top-K output: the first entry of its last row (select_top_k's order).
// -1 when the output has none.
int32_t greedy_token(const v1::SequenceOutput & out) {
    const size_t k = out.top_k();
    const size_t rows = out.n_rows();
    const std::string & ids = out.top_token_ids();
    if (k == 0 || rows == 0 || ids.size() != rows * k * sizeof(int32_t)) {
        return -1;
    }
    int32_t token = -1;
    std::memcpy(&token, ids.data() + (rows - 1) * k * sizeof(int32_t), sizeof(int32_t));  // little-endian
    return token;
}

}  // namespace

std::string ForwardStreamServer::run_ahead_refusal(const v1::ForwardRequest & request) const {
    const bool asked = std::any_of(request.entries().begin(), request.entries().end(),
                                   [](const v1::SequenceInput & in) {
                                       return in.run_ahead_steps() > 0 || in.stop_token_ids_size() > 0;
                                   });
    if (!asked) {
        return "";
    }
    if (!service_->takes_tokens() || !service_->gives_logits()) {
        return "run-ahead needs a worker holding the whole model (this one does not both take tokens and give "
               "logits)";
    }
    if (request.entries_size() != 1) {
        return "run-ahead needs exactly one entry, got " + std::to_string(request.entries_size());
    }
    const v1::SequenceInput & in = request.entries(0);
    if (in.top_k() == 0) {
        return "run-ahead needs top_k > 0 (the greedy token is the first of the top-K)";
    }
    if (in.logit_rows_size() > 1 ||
        (in.logit_rows_size() == 1 && static_cast<int>(in.logit_rows(0)) != in.token_ids_size() - 1)) {
        return "run-ahead needs the last row's logits only (logit_rows empty or the last row)";
    }
    return "";
}

bool ForwardStreamServer::run_ahead(int fd, const v1::SequenceInput & asked, v1::ForwardStreamReply * reply) {
    const std::unordered_set<int32_t> stop(asked.stop_token_ids().begin(), asked.stop_token_ids().end());
    const int32_t n_ctx = static_cast<int32_t>(service_->n_ctx_per_sequence());
    uint32_t left = asked.run_ahead_steps();
    v1::ForwardRequest next;  // the step the caller would send next, rewritten in place each time
    next.set_schema_version(v1::SCHEMA_VERSION_CURRENT);
    v1::SequenceInput * step = next.add_entries();
    step->set_seq_id(asked.seq_id());
    step->set_top_k(asked.top_k());
    step->add_positions(0);
    step->add_token_ids(0);
    for (;;) {
        const v1::SequenceOutput & out = reply->reply().entries(0);
        const int32_t token = greedy_token(out);
        const int32_t position = out.next_position();
        const bool more = left > 0 && token >= 0 && stop.count(token) == 0 && position < n_ctx;
        reply->set_run_ahead_more(more);
        if (!send_reply(fd, *reply)) {
            return false;
        }
        if (!more || frame_waiting(fd)) {
            return true;  // a frame waiting is read and answered by serve()
        }
        --left;
        step->set_positions(0, position);
        step->set_token_ids(0, token);
        reply->Clear();
        reply->set_schema_version(v1::SCHEMA_VERSION_CURRENT);
        reply->set_run_ahead(true);
        const grpc::Status status = service_->Forward(nullptr, &next, reply->mutable_reply());
        if (!status.ok()) {  // this step's frame says why, and the run ends
            reply->clear_reply();
            reply->set_code(static_cast<uint32_t>(status.error_code()));
            reply->set_message(status.error_message());
            return send_reply(fd, *reply);
        }
    }
}

ForwardStreamServer::ForwardStreamServer(ShardWorkerService * service, size_t max_request_bytes)
    : service_(service), max_request_bytes_(max_request_bytes) {}

ForwardStreamServer::~ForwardStreamServer() { stop(); }

std::string ForwardStreamServer::start(const std::string & path) {
    const std::string reason = free_socket_path(path);
    if (!reason.empty()) {
        return reason;
    }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);  // length checked by free_socket_path
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return std::string("cannot make a Unix socket: ") + std::strerror(errno);
    }
    const mode_t old_umask = ::umask(0177);  // created 0600, chmod-ed again below
    const int bound = ::bind(fd, reinterpret_cast<const sockaddr *>(&addr), sizeof(addr));
    ::umask(old_umask);
    if (bound != 0 || ::chmod(path.c_str(), 0600) != 0 || ::listen(fd, 16) != 0) {
        const std::string error = std::strerror(errno);
        ::close(fd);
        ::unlink(path.c_str());
        return "cannot listen on " + path + ": " + error;
    }
    path_ = path;
    listen_fd_ = fd;
    accept_thread_ = std::thread([this] { accept_loop(); });
    return "";
}

void ForwardStreamServer::stop() {
    std::list<Connection> connections;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_ || listen_fd_ < 0) {
            return;
        }
        stopping_ = true;
        ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept() (Linux)
        for (Connection & c : connections_) {
            ::shutdown(c.fd, SHUT_RDWR);  // wakes a blocked read; a Forward in progress finishes
        }
    }
    if (accept_thread_.joinable()) {
        accept_thread_.join();
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        connections.swap(connections_);
    }
    for (Connection & c : connections) {
        if (c.thread.joinable()) {
            c.thread.join();
        }
        ::close(c.fd);
    }
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(path_.c_str());
}

void ForwardStreamServer::accept_loop() {
    for (;;) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        std::unique_lock<std::mutex> lock(mu_);
        if (stopping_) {
            if (fd >= 0) {
                ::close(fd);
            }
            return;
        }
        if (fd < 0) {
            const int error = errno;
            if (error == EINTR || error == ECONNABORTED) {
                continue;
            }
            // Out of descriptors (or anything else): the connection waits in the backlog, so
            // retrying at once would spin; try again shortly, and keep serving the open ones.
            std::fprintf(stderr, "baton-worker: forward stream: accept failed: %s; retrying\n", std::strerror(error));
            lock.unlock();
            ::usleep(50 * 1000);
            continue;
        }
        // reap the connections that ended (their threads have returned)
        for (auto it = connections_.begin(); it != connections_.end();) {
            if (it->fd < 0) {
                it->thread.join();
                it = connections_.erase(it);
            } else {
                ++it;
            }
        }
        try {
            Connection & c = connections_.emplace_back();
            c.fd = fd;
            c.thread = std::thread([this, fd, &c] {
                serve(fd);
                std::lock_guard<std::mutex> done_lock(mu_);
                if (!stopping_) {  // else stop() shuts down, joins and closes it
                    ::close(fd);
                    c.fd = -1;  // reaped by the accept loop
                }
            });
        } catch (const std::exception & e) {  // no thread (or no memory) for it: refuse this one
            std::fprintf(stderr, "baton-worker: forward stream: cannot serve a connection: %s\n", e.what());
            if (!connections_.empty() && connections_.back().fd == fd && !connections_.back().thread.joinable()) {
                connections_.pop_back();
            }
            ::close(fd);
        }
    }
}

void ForwardStreamServer::serve(int fd) {
    try {
        std::string payload;
        v1::ForwardRequest request;
        v1::ForwardStreamReply reply;
        for (;;) {
            unsigned char prefix[kPrefixBytes];
            if (!read_full(fd, reinterpret_cast<char *>(prefix), kPrefixBytes)) {
                return;
            }
            const uint32_t size = read_le32(prefix);
            if (size > max_request_bytes_) {
                send_reply(fd, error_reply(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                           "forward stream: a frame of " + std::to_string(size) +
                                               " bytes is over the limit of " + std::to_string(max_request_bytes_) +
                                               "; closing the connection"));
                return;  // what follows is not at a frame boundary any more
            }
            payload.resize(size);
            if (!read_full(fd, payload.data(), size)) {
                return;  // truncated: the peer went away inside a frame
            }
            request.Clear();
            if (!request.ParseFromString(payload)) {
                if (!send_reply(fd, error_reply(grpc::StatusCode::INVALID_ARGUMENT,
                                                "forward stream: the frame is not a ForwardRequest"))) {
                    return;
                }
                continue;
            }
            reply.Clear();
            reply.set_schema_version(v1::SCHEMA_VERSION_CURRENT);
            if (request.entries_size() == 0) {  // a barrier (it ends a run-ahead): answered at once
                reply.mutable_reply()->set_schema_version(v1::SCHEMA_VERSION_CURRENT);
                if (!send_reply(fd, reply)) {
                    return;
                }
                continue;
            }
            const std::string refusal = run_ahead_refusal(request);
            const grpc::Status status = refusal.empty()
                                            ? service_->Forward(nullptr, &request, reply.mutable_reply())
                                            : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, refusal);
            if (!status.ok()) {
                reply.clear_reply();
                reply.set_code(static_cast<uint32_t>(status.error_code()));
                reply.set_message(status.error_message());
            } else if (request.entries(0).run_ahead_steps() > 0) {
                if (!run_ahead(fd, request.entries(0), &reply)) {
                    return;
                }
                continue;
            }
            if (!send_reply(fd, reply)) {
                return;
            }
        }
    } catch (const std::exception & e) {  // e.g. bad_alloc: this connection ends, the worker serves on
        std::fprintf(stderr, "baton-worker: forward stream: %s; closing the connection\n", e.what());
    } catch (...) {
        std::fprintf(stderr, "baton-worker: forward stream: unknown exception; closing the connection\n");
    }
}

}  // namespace baton
