// DataPlaneServer: see data_plane.h.
#include "data_plane.h"

#include "fd_io.h"
#include "sealed.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace baton {

namespace v1 = baton::worker::v1;

namespace {

constexpr size_t kPrefixBytes = 4;            // little-endian u32 length
constexpr int kDialTimeoutMs = 3000;
constexpr int kSendTimeoutS = 10;             // a peer that stops reading loses its connection
// TCP keepalive: a peer whose machine vanished without closing (power, network, a laptop's
// sleep) is found within ~idle + interval x count seconds, so its connection ends and frees
// its slot and thread; without it an idle connection from a gone owner or hop stays for ever.
constexpr int kKeepIdleS = 30;
constexpr int kKeepIntervalS = 10;
constexpr int kKeepCount = 3;
constexpr size_t kNoticeMaxLogBytes = 200;
// Decode steps a first hop remembers (continuation on): a copy from the other source comes
// within kContinueAheadSteps or so (the owner cannot fall further behind, see below).
constexpr size_t kTakenStepsKept = 64;
// How far a session's CONTINUE steps may run ahead of its owner's own steps at a first hop: a
// CONTINUE step this many past the owner's last waits until the owner catches up. Why: each
// continued step sends the owner a RESULT; an owner that stops reading (a laptop asleep, a
// stopped process) would otherwise fill its socket and block the last worker for everyone.
// Normally the owner's copy of a step comes within a step (it follows the RESULT), so a
// window of 4 never holds anything back.
constexpr uint32_t kContinueAheadSteps = 4;
std::string hex_of(const std::string & bytes) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out.push_back(digits[c >> 4]);
        out.push_back(digits[c & 15]);
    }
    return out;
}

// prefix + DataFrame, one buffer so that it is one send()
std::string framed(const v1::DataFrame & frame) {
    const size_t size = frame.ByteSizeLong();
    std::string out(kPrefixBytes + size, '\0');
    for (size_t i = 0; i < kPrefixBytes; ++i) {
        out[i] = static_cast<char>((size >> (8 * i)) & 0xff);
    }
    frame.SerializeToArray(out.data() + kPrefixBytes, static_cast<int>(size));
    return out;
}

std::string notice_frame(const std::string & session_id, const std::string & text) {
    v1::DataFrame frame;
    frame.set_schema_version(v1::SCHEMA_VERSION_CURRENT);
    frame.set_kind(v1::DATA_FRAME_KIND_NOTICE);
    frame.set_session_id(session_id);
    frame.set_notice(text);
    return framed(frame);
}

// A whole frame (length prefix included) of kind carrying body sealed under key; false (and a
// line on stderr) only when OpenSSL fails.
bool sealed_frame(const std::string & key, v1::DataFrameKind kind, const std::string & sid, uint64_t counter,
                  const std::string & body, std::string * out) {
    v1::DataFrame frame;
    frame.set_schema_version(v1::SCHEMA_VERSION_CURRENT);
    frame.set_kind(kind);
    frame.set_session_id(sid);
    frame.set_counter(counter);
    if (!seal_data_frame(key, static_cast<uint32_t>(kind), sid, counter, body, frame.mutable_sealed())) {
        std::fprintf(stderr, "baton-worker: data plane: cannot seal a frame for session %s\n", hex_of(sid).c_str());
        return false;
    }
    *out = framed(frame);
    return true;
}

uint32_t grpc_code(ErrorCode code) { return static_cast<uint32_t>(to_grpc_status({code, ""}).error_code()); }

void set_socket_options(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // a step is one small write
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepIdleS, sizeof(kKeepIdleS));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepIntervalS, sizeof(kKeepIntervalS));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &kKeepCount, sizeof(kKeepCount));
    timeval timeout{};
    timeout.tv_sec = kSendTimeoutS;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

// A connected TCP socket to host:port, or -1 and *error.
int dial(const std::string & host, uint16_t port, std::string * error) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found = nullptr;
    const std::string service = std::to_string(port);
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    if (rc != 0) {
        *error = "cannot resolve " + host + ": " + ::gai_strerror(rc);
        return -1;
    }
    int fd = -1;
    *error = "no address for " + host;
    for (addrinfo * a = found; a != nullptr && fd < 0; a = a->ai_next) {
        fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            *error = std::string("socket: ") + std::strerror(errno);
            continue;
        }
        int result = ::connect(fd, a->ai_addr, a->ai_addrlen);
        if (result != 0 && errno == EINPROGRESS) {
            pollfd p{fd, POLLOUT, 0};
            result = ::poll(&p, 1, kDialTimeoutMs) == 1 ? 0 : -1;
            int so_error = result == 0 ? 0 : ETIMEDOUT;
            socklen_t len = sizeof(so_error);
            if (result == 0) {
                ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
            }
            errno = so_error;
            result = so_error == 0 ? 0 : -1;
        }
        if (result != 0) {
            *error = "cannot connect to " + host + ":" + service + ": " + std::strerror(errno);
            ::close(fd);
            fd = -1;
            continue;
        }
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        set_socket_options(fd);
    }
    ::freeaddrinfo(found);
    return fd;
}

}  // namespace

bool parse_host_port(const std::string & text, std::string * host, uint16_t * port, std::string * error) {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
        *error = "'" + text + "' is not HOST:PORT";
        return false;
    }
    std::string h = text.substr(0, colon);
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
        h = h.substr(1, h.size() - 2);
    }
    const std::string p = text.substr(colon + 1);
    char * end = nullptr;
    errno = 0;
    const unsigned long value = std::strtoul(p.c_str(), &end, 10);
    if (errno != 0 || end == p.c_str() || *end != '\0' || value > 65535 || p[0] == '-' || p[0] == '+') {
        *error = "the port in '" + text + "' is not a number from 0 to 65535";
        return false;
    }
    *host = h;
    *port = static_cast<uint16_t>(value);
    return true;
}

DataPlaneServer::DataPlaneServer(ShardWorkerService * service, const DataPlaneLimits & limits)
    : service_(service),
      engine_(service->engine()),
      max_frame_bytes_(limits.max_frame_bytes),
      unproven_timeout_(limits.unproven_timeout),
      max_connections_(limits.max_connections) {}

DataPlaneServer::~DataPlaneServer() { stop(); }

std::string DataPlaneServer::start(const std::string & host, uint16_t port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo * found = nullptr;
    const std::string service = std::to_string(port);
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    if (rc != 0) {
        return "cannot resolve " + host + ": " + ::gai_strerror(rc);
    }
    std::string reason = "no address for " + host;
    int fd = -1;
    for (addrinfo * a = found; a != nullptr && fd < 0; a = a->ai_next) {
        fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        const int one = 1;
        if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
            ::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
            reason = "cannot listen on " + host + ":" + service + ": " + std::strerror(errno);
            if (fd >= 0) {
                ::close(fd);
            }
            fd = -1;
        }
    }
    ::freeaddrinfo(found);
    if (fd < 0) {
        return reason;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr *>(&bound), &len);
    const uint16_t bound_port = bound.ss_family == AF_INET6
                                    ? ntohs(reinterpret_cast<sockaddr_in6 *>(&bound)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in *>(&bound)->sin_port);
    port_.store(bound_port, std::memory_order_relaxed);
    listen_fd_ = fd;
    engine_.set_step_sink(this);
    accept_thread_ = std::thread([this] { accept_loop(); });
    return "";
}

void DataPlaneServer::stop() {
    std::list<std::shared_ptr<Connection>> connections;
    {
        std::lock_guard<std::mutex> lock(conn_mu_);
        if (stopping_) {
            return;
        }
        stopping_ = true;
        if (listen_fd_ >= 0) {
            ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept() (Linux)
        }
        for (const auto & c : connections_) {
            ::shutdown(c->fd, SHUT_RDWR);  // wakes its reader; a step being computed finishes
        }
        outbound_.clear();
    }
    if (accept_thread_.joinable()) {
        accept_thread_.join();
    }
    engine_.set_step_sink(nullptr);  // returns once a batch being computed has been sent on
    {
        std::lock_guard<std::mutex> lock(conn_mu_);
        connections.swap(connections_);
    }
    for (const auto & c : connections) {
        if (c->thread.joinable()) {
            c->thread.join();
        }
    }
    if (listen_fd_ >= 0) {
        ::close(listen_fd_);
        listen_fd_ = -1;
    }
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.clear();  // drops the weak sinks; the connections close with their last owner
}

std::shared_ptr<DataPlaneServer::Connection> DataPlaneServer::add_connection(int fd,
                                                                             const std::string & outbound_address) {
    std::lock_guard<std::mutex> lock(conn_mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {  // reap the ended ones
        if ((*it)->finished.load()) {
            (*it)->thread.join();
            it = connections_.erase(it);
        } else {
            ++it;
        }
    }
    if (stopping_ || !make_room()) {
        if (!stopping_) {
            std::fprintf(stderr, "baton-worker: data plane: %zu connections open, all proven; refusing another\n",
                         connections_.size());
        }
        ::close(fd);
        return nullptr;
    }
    auto conn = std::shared_ptr<Connection>(new Connection, [](Connection * c) {
        if (c->fd >= 0) {
            ::close(c->fd);  // only once nobody can send on it any more
        }
        delete c;
    });
    conn->fd = fd;
    conn->outbound_address = outbound_address;
    conn->proven.store(!outbound_address.empty());  // dialled by this worker: its own choice
    conn->opened_at = std::chrono::steady_clock::now();
    try {
        conn->thread = std::thread([this, conn] {
            serve(conn);
            connection_ended(conn.get());
            conn->open.store(false);
            ::shutdown(conn->fd, SHUT_RDWR);
            {
                std::lock_guard<std::mutex> done(conn_mu_);
                auto found = outbound_.find(conn->outbound_address);
                if (found != outbound_.end() && found->second == conn) {
                    outbound_.erase(found);
                }
            }
            conn->finished.store(true);
        });
    } catch (const std::exception & e) {
        std::fprintf(stderr, "baton-worker: data plane: cannot serve a connection: %s\n", e.what());
        return nullptr;  // conn's deleter closes fd
    }
    connections_.push_back(conn);
    return conn;
}

bool DataPlaneServer::make_room() {
    size_t live = 0;
    Connection * oldest_unproven = nullptr;
    for (const auto & c : connections_) {
        if (c->finished.load() || c->evicted.load()) {
            continue;  // its thread is ending: reaped by a later add_connection
        }
        ++live;
        if (!c->proven.load() && c->outbound_address.empty() &&
            (oldest_unproven == nullptr || c->opened_at < oldest_unproven->opened_at)) {
            oldest_unproven = c.get();
        }
    }
    if (live < max_connections_) {
        return true;
    }
    if (oldest_unproven == nullptr) {
        return false;
    }
    oldest_unproven->evicted.store(true);
    ::shutdown(oldest_unproven->fd, SHUT_RDWR);  // wakes its reader, which ends
    ++evictions_;
    if ((evictions_ & (evictions_ - 1)) == 0) {  // 1, 2, 4, ...: a flood cannot fill the log
        std::fprintf(stderr,
                     "baton-worker: data plane: every connection slot taken; %llu unproven connection(s) closed "
                     "so far to make room\n",
                     static_cast<unsigned long long>(evictions_));
    }
    return true;
}

bool DataPlaneServer::set_read_deadline(Connection & conn) {
    timeval timeout{};
    if (!conn.proven.load()) {
        const auto left = conn.opened_at + unproven_timeout_ - std::chrono::steady_clock::now();
        const auto left_us = std::chrono::duration_cast<std::chrono::microseconds>(left).count();
        if (left_us <= 0) {
            const std::string notice = notice_frame(
                "", "data plane: no frame of a session bound here opened within " +
                        std::to_string(unproven_timeout_.count()) + " ms of connecting; closing the connection");
            std::lock_guard<std::mutex> lock(conn.send_mu);
            write_full(conn.fd, notice.data(), notice.size());
            return false;
        }
        timeout.tv_sec = static_cast<time_t>(left_us / 1000000);
        timeout.tv_usec = static_cast<suseconds_t>(std::max<long long>(left_us % 1000000, 1000));
    } else if (!conn.read_deadline_set) {
        return true;
    }
    ::setsockopt(conn.fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));  // {0, 0}: none
    conn.read_deadline_set = !conn.proven.load();
    return true;
}

void DataPlaneServer::accept_loop() {
    for (;;) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
            const int error = errno;
            {
                std::lock_guard<std::mutex> lock(conn_mu_);
                if (stopping_) {
                    return;
                }
            }
            if (error == EINTR || error == ECONNABORTED) {
                continue;
            }
            std::fprintf(stderr, "baton-worker: data plane: accept failed: %s; retrying\n", std::strerror(error));
            ::usleep(50 * 1000);  // out of descriptors: the connection waits in the backlog
            continue;
        }
        set_socket_options(fd);
        add_connection(fd, "");
    }
}

std::shared_ptr<DataPlaneServer::Connection> DataPlaneServer::outbound(const std::string & host, uint16_t port,
                                                                       std::string * error) {
    const std::string address = host + ":" + std::to_string(port);
    {
        std::lock_guard<std::mutex> lock(conn_mu_);
        auto found = outbound_.find(address);
        if (found != outbound_.end() && found->second->open.load()) {
            return found->second;
        }
    }
    const int fd = dial(host, port, error);
    if (fd < 0) {
        return nullptr;
    }
    std::shared_ptr<Connection> conn = add_connection(fd, address);
    if (!conn) {
        *error = "no room for another connection";
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(conn_mu_);
    auto & slot = outbound_[address];
    if (slot && slot->open.load()) {
        // another thread dialled the same address meanwhile: keep one (this one ends unused)
        ::shutdown(conn->fd, SHUT_RDWR);
        return slot;
    }
    slot = conn;
    return conn;
}

std::string DataPlaneServer::bind(const DataBinding & b) {
    if (b.next_port != 0) {
        std::string error;
        if (!outbound(b.next_host, b.next_port, &error)) {
            return "the next hop's data plane: " + error;
        }
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto previous = sessions_.find(b.session_id);
    if (previous != sessions_.end() &&
        (previous->second.step_key == b.step_key ||
         (!b.next_step_key.empty() && previous->second.next_step_key == b.next_step_key) ||
         (!b.return_key.empty() && previous->second.return_key == b.return_key) ||
         (!b.continue_key.empty() && previous->second.continue_key == b.continue_key))) {
        // its counters start again: the same key would seal under nonces already used
        return "a binding must bring fresh keys (these are the session's current ones)";
    }
    Session & s = sessions_[b.session_id];
    if (s.generation != 0) {
        engine_.unbind(s.generation);  // its queued steps are dropped
    }
    const uint64_t generation = ++next_generation_;
    s = Session{};
    s.generation = generation;
    s.seq_id = b.seq_id;
    s.step_key = b.step_key;
    s.next_step = b.next_step;
    s.next_host = b.next_host;
    s.next_port = b.next_port;
    s.next_step_key = b.next_step_key;
    s.return_key = b.return_key;
    s.keep_max = b.keep_rows_max_bytes;
    s.continue_key = b.continue_key;
    engine_.bind(generation, b.decode_gather_us, b.decode_groups);
    return "";
}

std::string DataPlaneServer::continue_session(const DataContinuation & c) {
    std::string error;
    if (!outbound(c.host, c.port, &error)) {  // reachable now, not a lost step later
        return "the first hop's data plane: " + error;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sessions_.find(c.session_id);
    if (found == sessions_.end()) {
        return "no session " + hex_of(c.session_id) + " is bound here";
    }
    Session & s = found->second;
    if (!s.cont_key.empty()) {
        // its counter would start again under the same key: once per binding
        return "the session continues already (once per binding)";
    }
    if (c.continue_key == s.step_key || c.continue_key == s.return_key) {
        return "the continue_key must be a key of its own";
    }
    s.cont_host = c.host;
    s.cont_port = c.port;
    s.cont_key = c.continue_key;
    s.cont_left = c.steps;
    s.cont_stop = c.stop_token_ids;
    s.cont_max_position = c.max_position;
    return "";
}

DataSessionTotals DataPlaneServer::unbind(const std::string & session_id, bool keep_bound) {
    std::lock_guard<std::mutex> lock(mu_);
    DataSessionTotals totals;
    auto found = sessions_.find(session_id);
    if (found == sessions_.end()) {
        return totals;
    }
    totals.was_bound = true;
    totals.rows = found->second.rows;
    totals.steps = found->second.steps;
    totals.next_step = found->second.next_step;
    totals.seq_id = found->second.seq_id;
    totals.kept_rows_lost = found->second.kept_lost;
    totals.compute_us = found->second.compute_us;
    totals.in_worker_us = found->second.in_worker_us;
    totals.continued_steps = std::max(found->second.continued_in, found->second.continued_out);
    totals.duplicate_steps_dropped = found->second.duplicates_dropped;
    totals.continue_steps_waiting = static_cast<uint32_t>(found->second.parked.size());
    if (keep_bound) {
        return totals;
    }
    if (!found->second.kept_lost && found->second.kept_first >= 0) {
        totals.kept_rows.swap(found->second.kept);
        totals.kept_first_position = found->second.kept_first;
    }
    engine_.unbind(found->second.generation);  // its queued steps are dropped
    sessions_.erase(found);
    return totals;
}

void DataPlaneServer::serve(const std::shared_ptr<Connection> & conn) {
    try {
        // Every whole frame one read() brings is taken before computing, so that steps that
        // arrive together (several sessions' outputs of one Forward upstream) share a Forward.
        std::string buffer;
        size_t start = 0;
        char chunk[1 << 16];
        std::vector<Pending> arrived;
        for (;;) {
            while (buffer.size() - start >= kPrefixBytes) {
                const auto * p = reinterpret_cast<const unsigned char *>(buffer.data() + start);
                const uint32_t size = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                                      static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
                if (size > max_frame_bytes_) {
                    post_arrived(arrived);
                    const std::string notice = notice_frame(
                        "", "data plane: a frame of " + std::to_string(size) + " bytes is over the limit of " +
                                std::to_string(max_frame_bytes_) + "; closing the connection");
                    std::lock_guard<std::mutex> lock(conn->send_mu);
                    write_full(conn->fd, notice.data(), notice.size());
                    return;  // what follows is not at a frame boundary any more
                }
                if (buffer.size() - start - kPrefixBytes < size) {
                    break;
                }
                const bool keep = handle_frame(conn, buffer.data() + start + kPrefixBytes, size, &arrived);
                start += kPrefixBytes + size;
                if (!keep) {
                    post_arrived(arrived);  // the steps read before the bad frame are still computed
                    return;
                }
            }
            post_arrived(arrived);
            buffer.erase(0, start);
            start = 0;
            if (!set_read_deadline(*conn)) {
                return;  // unproven, and out of time
            }
            const ssize_t got = ::read(conn->fd, chunk, sizeof(chunk));
            if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
                continue;  // (EAGAIN: the unproven deadline passed; the next set_read_deadline says so)
            }
            if (got <= 0) {
                return;  // the peer closed (inside a frame: truncated) or the socket failed
            }
            buffer.append(chunk, static_cast<size_t>(got));
        }
    } catch (const std::exception & e) {  // e.g. bad_alloc: this connection ends, the worker serves on
        std::fprintf(stderr, "baton-worker: data plane: %s; closing the connection\n", e.what());
    } catch (...) {
        std::fprintf(stderr, "baton-worker: data plane: unknown exception; closing the connection\n");
    }
}

bool DataPlaneServer::handle_frame(const std::shared_ptr<Connection> & conn, const char * data, size_t size,
                                   std::vector<Pending> * arrived) {
    auto refuse = [&](const std::string & session_id, const std::string & why, bool close) {
        const std::string notice = notice_frame(session_id, "data plane: " + why);
        std::lock_guard<std::mutex> lock(conn->send_mu);
        return write_full(conn->fd, notice.data(), notice.size()) && !close;
    };
    v1::DataFrame frame;
    if (!frame.ParseFromArray(data, static_cast<int>(size))) {
        return refuse("", "the frame is not a DataFrame; closing the connection", true);
    }
    if (frame.schema_version() != v1::SCHEMA_VERSION_CURRENT) {
        return refuse("", "DataFrame schema_version " + std::to_string(frame.schema_version()) +
                              " is not the one this worker speaks (1); closing the connection", true);
    }
    const std::string & sid = frame.session_id();
    const uint32_t kind = static_cast<uint32_t>(frame.kind());
    switch (frame.kind()) {
    case v1::DATA_FRAME_KIND_NOTICE:
        if (conn->proven.load()) {  // (anyone may connect: an unproven peer's notices would fill the log)
            std::fprintf(stderr, "baton-worker: data plane: the peer says: %s\n",
                         frame.notice().substr(0, kNoticeMaxLogBytes).c_str());
        }
        return true;
    case v1::DATA_FRAME_KIND_RESULT:
        return refuse(sid, "a worker takes no RESULT frames", false);
    case v1::DATA_FRAME_KIND_STEP:
    case v1::DATA_FRAME_KIND_ATTACH:
    case v1::DATA_FRAME_KIND_CONTINUE:
        break;
    default:
        return refuse(sid, "unknown frame kind " + std::to_string(kind) + "; closing the connection", true);
    }

    std::string plain;
    std::string undelivered;
    std::string refusal;  // written after mu_ is released: a peer that does not read blocks only itself
    {
        std::lock_guard<std::mutex> lock(mu_);
        refusal = [&]() -> std::string {
            auto found = sessions_.find(sid);
            if (found == sessions_.end()) {
                return "no session " + hex_of(sid) + " is bound here";
            }
            Session & s = found->second;
            const bool continued = frame.kind() == v1::DATA_FRAME_KIND_CONTINUE;
            const bool step = frame.kind() == v1::DATA_FRAME_KIND_STEP || continued;
            const std::string & key = continued ? s.continue_key : step ? s.step_key : s.return_key;
            uint64_t & last = continued ? s.last_continue_counter : step ? s.last_step_counter : s.last_attach_counter;
            if (key.empty()) {
                return std::string(continued ? "CONTINUE" : step ? "STEP" : "ATTACH") +
                       " frames are not taken for session " + hex_of(sid) + " here";
            }
            if (frame.counter() <= last) {
                return "counter " + std::to_string(frame.counter()) + " is not above the last one taken (" +
                                       std::to_string(last) + "): a replayed or stale frame";
            }
            if (!open_data_frame(key, kind, sid, frame.counter(), frame.sealed(), &plain)) {
                return "the frame does not open under session " + hex_of(sid) +
                                       "'s key (a peer without the key, or changed bytes)";
            }
            last = frame.counter();
            conn->proven.store(true);
            if (!step) {
                v1::DataAttach attach;
                if (!attach.ParseFromString(plain)) {
                    return "the ATTACH body is not a DataAttach";
                }
                s.sink = conn;
                undelivered.swap(s.undelivered);
            } else {
                Pending pending;
                pending.session_id = sid;
                pending.generation = s.generation;
                pending.seq_id = s.seq_id;
                pending.read_at = std::chrono::steady_clock::now();
                const bool parsed = pending.step.ParseFromString(plain);
                s.source = conn.get();
                take_step(s, std::move(pending), parsed, continued, arrived);
            }
            return "";
        }();
    }
    if (!refusal.empty()) {
        return refuse(sid, refusal, false);
    }
    if (!undelivered.empty()) {
        std::lock_guard<std::mutex> lock(conn->send_mu);
        write_full(conn->fd, undelivered.data(), undelivered.size());
    }
    return true;
}

void DataPlaneServer::run_steps(Shard & shard, std::vector<StepWork> && steps) {
    std::vector<Pending> batch = std::move(steps);
    {
        // Compute: each entry checked alone first, so that one session's bad step is refused
        // alone; the rest in one Forward.
        std::vector<ShardStatus> status(batch.size());
        std::vector<ForwardOutput> outputs(batch.size());
        uint64_t compute_us = 0;
        {
            // Unbound since it was taken: not computed. (UnbindSession reads the sequence's
            // positions on the engine after unbinding, so it sees every step computed.)
            std::lock_guard<std::mutex> lock(mu_);
            for (size_t i = 0; i < batch.size(); ++i) {
                auto s = sessions_.find(batch[i].session_id);
                if (s == sessions_.end() || s->second.generation != batch[i].generation) {
                    status[i] = ShardStatus::Precondition("unbound");
                }
            }
        }
        [&] {
            const ForwardLimits limits = shard.limits();
            std::vector<int32_t> next(limits.n_seq_max);
            for (uint32_t q = 0; q < limits.n_seq_max; ++q) {
                next[q] = shard.next_position(q);
            }
            std::vector<ForwardEntry> entries;
            std::vector<size_t> index;
            for (size_t i = 0; i < batch.size(); ++i) {
                const v1::DataStep & st = batch[i].step;
                if (st.error_code() != 0 || !status[i].ok()) {
                    continue;
                }
                ForwardEntry e;
                e.seq_id = batch[i].seq_id;
                e.positions.assign(st.positions().begin(), st.positions().end());
                e.token_ids.assign(st.token_ids().begin(), st.token_ids().end());
                e.boundary = st.boundary();
                e.boundary_dtype = static_cast<BoundaryDType>(st.boundary_dtype());
                e.boundary_schema_version = st.boundary_schema_version();
                e.boundary_streams = st.boundary_streams();
                e.top_k = st.top_k();
                status[i] = validate_forward(limits, {e}, next);
                if (status[i].ok()) {
                    entries.push_back(std::move(e));
                    index.push_back(i);
                }
            }
            if (entries.empty()) {
                return;
            }
            std::vector<ForwardOutput> outs;
            const auto started = std::chrono::steady_clock::now();
            const ShardStatus st = shard.forward(entries, &outs);
            compute_us = static_cast<uint64_t>(
                std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started)
                    .count());
            for (size_t j = 0; j < index.size(); ++j) {
                status[index[j]] = st;
                if (st.ok()) {
                    outputs[index[j]] = std::move(outs[j]);
                }
            }
            if (st.ok()) {
                service_->count_forward();
                forwards_.fetch_add(1, std::memory_order_relaxed);
                steps_.fetch_add(index.size(), std::memory_order_relaxed);
                compute_us_.fetch_add(compute_us, std::memory_order_relaxed);
            }
        }();

        std::vector<Outgoing> outgoing;
        outgoing.reserve(batch.size());
        auto seal_into = [&](const Pending & pending, const std::string & body, bool to_owner) {
            Outgoing o;
            if (seal_output(pending, body, to_owner, &o)) {
                outgoing.push_back(std::move(o));
            }
            return std::chrono::steady_clock::now();  // the send (it wakes the receiver) is not the worker's
        };
        for (size_t i = 0; i < batch.size(); ++i) {
            v1::DataStep & st = batch[i].step;
            if (st.error_code() == 0 && !status[i].ok()) {
                st.set_error_code(grpc_code(status[i].code));
                st.set_error_message(status[i].message);
                st.set_error_layer_begin(service_->layer_begin());
            }
            const bool ok = st.error_code() == 0;
            std::chrono::steady_clock::time_point ready_at;
            if (service_->gives_logits()) {
                v1::DataResult result;
                result.set_step(st.step());
                result.set_n_vocab(service_->n_vocab());
                if (!ok) {
                    result.set_error_code(st.error_code());
                    result.set_error_message(st.error_message());
                    result.set_error_layer_begin(st.error_layer_begin());
                } else {
                    ForwardOutput & o = outputs[i];
                    result.set_next_position(o.next_position);
                    if (o.top_k > 0 && st.positions_size() == 1 && o.top_token_ids.size() >= sizeof(int32_t)) {
                        int32_t token = 0;  // the greedy token: the first of the top-K (little-endian)
                        std::memcpy(&token, o.top_token_ids.data(), sizeof(int32_t));
                        Outgoing next;  // (deliver writes the RESULTs to owners before it)
                        if (seal_continuation(batch[i], token, o.next_position, &next)) {
                            outgoing.push_back(std::move(next));
                        }
                    }
                    if (o.top_k > 0) {
                        result.set_top_k(o.top_k);
                        result.set_top_token_ids(std::move(o.top_token_ids));
                        result.set_top_logits(std::move(o.top_logits));
                        result.set_log_sum_exp(o.log_sum_exp.empty() ? 0.0 : o.log_sum_exp.back());
                    } else {
                        result.set_logits(std::move(o.logits));
                    }
                }
                ready_at = seal_into(batch[i], result.SerializeAsString(), true);
            } else {
                v1::DataStep next;
                next.set_step(st.step());
                next.set_top_k(st.top_k());
                if (!ok) {
                    next.set_error_code(st.error_code());
                    next.set_error_message(st.error_message());
                    next.set_error_layer_begin(st.error_layer_begin());
                } else {
                    ForwardOutput & o = outputs[i];
                    keep_rows(batch[i], st.positions(0), o.boundary);
                    next.mutable_positions()->CopyFrom(st.positions());
                    next.set_boundary(std::move(o.boundary));
                    next.set_boundary_dtype(v1::DTYPE_F32);
                    next.set_boundary_schema_version(service_->boundary_schema().version);
                    next.set_boundary_streams(service_->boundary_schema().streams);
                }
                ready_at = seal_into(batch[i], next.SerializeAsString(), false);
            }
            if (ok) {
                const auto in_worker = ready_at - batch[i].read_at;
                std::lock_guard<std::mutex> lock(mu_);
                auto s = sessions_.find(batch[i].session_id);
                if (s != sessions_.end() && s->second.generation == batch[i].generation) {
                    s->second.rows += static_cast<uint64_t>(st.positions_size());
                    s->second.steps += 1;
                    s->second.compute_us += compute_us;
                    s->second.in_worker_us += static_cast<uint64_t>(
                        std::chrono::duration_cast<std::chrono::microseconds>(in_worker).count());
                }
            }
        }
        deliver(outgoing);
    }
}

void DataPlaneServer::keep_rows(const Pending & pending, int32_t first_position, const std::string & rows) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sessions_.find(pending.session_id);
    if (found == sessions_.end() || found->second.generation != pending.generation) {
        return;
    }
    Session & s = found->second;
    if (s.keep_max == 0 || s.kept_lost) {
        return;
    }
    if (s.kept_first < 0) {
        s.kept_first = first_position;
    }
    const size_t row_bytes = static_cast<size_t>(service_->boundary_schema().row_values()) * sizeof(float);
    const size_t held_rows = row_bytes == 0 ? 0 : s.kept.size() / row_bytes;
    if (static_cast<int64_t>(s.kept_first) + static_cast<int64_t>(held_rows) != first_position ||
        s.kept.size() + rows.size() > s.keep_max) {
        s.kept_lost = true;  // a gap, or over the budget: the node cannot rebuild from these
        std::string().swap(s.kept);
        return;
    }
    s.kept.append(rows);
}

bool DataPlaneServer::seal_output(const Pending & pending, const std::string & body, bool to_owner, Outgoing * out) {
    const std::string & sid = pending.session_id;
    std::string key;
    uint64_t counter = 0;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto s = sessions_.find(sid);
        if (s == sessions_.end() || s->second.generation != pending.generation) {
            return false;  // unbound while it was computed
        }
        counter = ++s->second.out_counter;
        key = to_owner ? s->second.return_key : s->second.next_step_key;
        out->host = s->second.next_host;
        out->port = s->second.next_port;
    }
    // a bound session's keys are 32 bytes (the service checks), so sealing cannot fail
    if (!sealed_frame(key, to_owner ? v1::DATA_FRAME_KIND_RESULT : v1::DATA_FRAME_KIND_STEP, sid, counter, body,
                      &out->frame)) {
        return false;
    }
    out->to_owner = to_owner;
    out->session_id = sid;
    out->generation = pending.generation;
    return true;
}

void DataPlaneServer::take_step(Session & s, Pending && pending, bool parsed, bool continued,
                                std::vector<Pending> * arrived) {
    v1::DataStep & st = pending.step;
    const bool decode_step = parsed && st.error_code() == 0 && st.positions_size() == 1 && st.token_ids_size() == 1;
    if (!continued && parsed) {
        s.owner_next_step = std::max(s.owner_next_step, st.step() + 1);
    }
    if (decode_step && !s.continue_key.empty() && st.step() < s.next_step &&
        std::any_of(s.taken.begin(), s.taken.end(), [&](const Session::Taken & t) {
            return t.step == st.step() && t.position == st.positions(0) && t.token == st.token_ids(0);
        })) {
        ++s.duplicates_dropped;  // the other source's copy came first: nothing to do
    } else if (continued && decode_step && st.step() == s.next_step &&
               st.step() >= s.owner_next_step + kContinueAheadSteps) {
        s.parked.push_back(std::move(pending));  // the owner is behind: wait for it (see the header)
    } else {
        if (!parsed) {
            st.Clear();
            st.set_error_code(grpc_code(ErrorCode::kInvalidArgument));
            st.set_error_message("the STEP body is not a DataStep");
            st.set_error_layer_begin(service_->layer_begin());
        } else if (st.error_code() == 0 && st.step() != s.next_step) {
            const uint32_t got = st.step();
            st.Clear();
            st.set_step(got);
            st.set_error_code(grpc_code(ErrorCode::kFailedPrecondition));
            st.set_error_message("step " + std::to_string(got) + " arrived where step " +
                                 std::to_string(s.next_step) + " was expected");
            st.set_error_layer_begin(service_->layer_begin());
        }
        enqueue_step(s, std::move(pending), decode_step, continued, arrived);
    }
    // parked CONTINUE steps the owner has caught up with (or sent itself meanwhile)
    while (!s.parked.empty()) {
        Pending & p = s.parked.front();
        if (p.step.step() < s.next_step) {
            ++s.duplicates_dropped;  // the owner's copy was taken
        } else if (p.step.step() == s.next_step && p.step.step() < s.owner_next_step + kContinueAheadSteps) {
            enqueue_step(s, std::move(p), true, true, arrived);
        } else {
            break;
        }
        s.parked.pop_front();
    }
}

void DataPlaneServer::enqueue_step(Session & s, Pending && pending, bool decode_step, bool continued,
                                   std::vector<Pending> * arrived) {
    const v1::DataStep & st = pending.step;
    if (st.step() == s.next_step) {
        ++s.next_step;  // refused or not, the next one follows it
        if (!s.continue_key.empty() && decode_step) {
            s.taken.push_back({st.step(), st.positions(0), st.token_ids(0)});
            if (s.taken.size() > kTakenStepsKept) {
                s.taken.pop_front();
            }
            s.continued_in += continued ? 1 : 0;
        }
    }
    arrived->push_back(std::move(pending));
}

void DataPlaneServer::post_arrived(std::vector<Pending> & arrived) {
    if (arrived.empty()) {
        return;
    }
    {
        // Under mu_: a session's steps reach the engine in the order they were taken, and a
        // session unbound since (its binding's generation gone) is not posted.
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<Pending> bound;
        bound.reserve(arrived.size());
        for (Pending & p : arrived) {
            const auto s = sessions_.find(p.session_id);
            if (s != sessions_.end() && s->second.generation == p.generation) {
                bound.push_back(std::move(p));
            }
        }
        engine_.post_steps(std::move(bound));
    }
    arrived.clear();
}

void DataPlaneServer::connection_ended(const Connection * conn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto & [sid, s] : sessions_) {
        if (s.source == conn) {
            s.source = nullptr;
            engine_.peer_lost(s.generation);
        }
    }
}

bool DataPlaneServer::seal_continuation(const Pending & pending, int32_t token, int32_t position, Outgoing * out) {
    const std::string & sid = pending.session_id;
    std::string key;
    uint64_t counter = 0;
    v1::DataStep step;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto found = sessions_.find(sid);
        if (found == sessions_.end() || found->second.generation != pending.generation) {
            return false;
        }
        Session & s = found->second;
        const int32_t n_ctx = static_cast<int32_t>(service_->n_ctx_per_sequence());
        if (s.cont_key.empty() || s.cont_left == 0) {
            return false;
        }
        if (std::find(s.cont_stop.begin(), s.cont_stop.end(), token) != s.cont_stop.end() || position >= n_ctx ||
            (s.cont_max_position > 0 && position >= s.cont_max_position)) {
            s.cont_left = 0;  // the generation ends here: a step the owner still sends is its own
            return false;
        }
        --s.cont_left;
        ++s.continued_out;
        counter = ++s.cont_counter;
        key = s.cont_key;
        out->host = s.cont_host;
        out->port = s.cont_port;
    }
    step.set_step(pending.step.step() + 1);
    step.add_positions(position);
    step.add_token_ids(token);
    step.set_top_k(pending.step.top_k());
    if (!sealed_frame(key, v1::DATA_FRAME_KIND_CONTINUE, sid, counter, step.SerializeAsString(), &out->frame)) {
        return false;
    }
    out->to_owner = false;
    out->session_id = sid;
    out->generation = pending.generation;
    return true;
}

void DataPlaneServer::deliver(std::vector<Outgoing> & outgoing) {
    // The frames for one connection go in one write, in the Forward's order: the receiver
    // reads them together and computes them in one Forward (sent one by one, the first would
    // often start a Forward alone while the rest are still arriving).
    std::vector<std::pair<std::shared_ptr<Connection>, std::string>> to_owners;
    std::vector<std::pair<std::string, std::string>> to_hops;  // ("host:port", frames)
    std::unordered_map<std::string, std::pair<std::string, uint16_t>> where;
    for (Outgoing & o : outgoing) {
        if (o.to_owner) {
            std::shared_ptr<Connection> sink;
            {
                std::lock_guard<std::mutex> lock(mu_);
                auto s = sessions_.find(o.session_id);
                if (s == sessions_.end() || s->second.generation != o.generation) {
                    continue;
                }
                sink = s->second.sink.lock();
                if (!sink || !sink->open.load()) {  // the owner has not attached (yet)
                    // kept, in order, and sent on the owner's ATTACH: with greedy continuation
                    // several results (at most the continuation's window) may come first
                    s->second.undelivered += o.frame;
                    continue;
                }
            }
            auto group = std::find_if(to_owners.begin(), to_owners.end(), [&](const auto & g) { return g.first == sink; });
            if (group == to_owners.end()) {
                to_owners.emplace_back(sink, std::move(o.frame));
            } else {
                group->second += o.frame;
            }
        } else {
            const std::string address = o.host + ":" + std::to_string(o.port);
            where.emplace(address, std::make_pair(o.host, o.port));
            auto group = std::find_if(to_hops.begin(), to_hops.end(), [&](const auto & g) { return g.first == address; });
            if (group == to_hops.end()) {
                to_hops.emplace_back(address, std::move(o.frame));
            } else {
                group->second += o.frame;
            }
        }
    }
    for (auto & [sink, frames] : to_owners) {
        std::lock_guard<std::mutex> lock(sink->send_mu);
        if (!write_full(sink->fd, frames.data(), frames.size())) {
            std::fprintf(stderr, "baton-worker: data plane: an owner is gone; its results dropped\n");
            sink->open.store(false);
            ::shutdown(sink->fd, SHUT_RDWR);  // part of a frame may be out: nothing more on it
        }
    }
    for (auto & [address, frames] : to_hops) {
        const auto & [host, port] = where[address];
        bool sent = false;
        for (int attempt = 0; attempt < 2 && !sent; ++attempt) {  // a stale connection is dialled again once
            std::string error;
            std::shared_ptr<Connection> conn = outbound(host, port, &error);
            if (!conn) {
                std::fprintf(stderr, "baton-worker: data plane: the next hop %s: %s; steps dropped\n", address.c_str(),
                             error.c_str());
                break;
            }
            std::lock_guard<std::mutex> lock(conn->send_mu);
            sent = write_full(conn->fd, frames.data(), frames.size());
            if (!sent) {
                conn->open.store(false);
                ::shutdown(conn->fd, SHUT_RDWR);
            }
        }
        if (!sent) {
            std::fprintf(stderr, "baton-worker: data plane: the next hop %s does not take frames; steps dropped\n",
                         address.c_str());
        }
    }
}

}  // namespace baton
