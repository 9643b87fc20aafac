// DataPlaneServer's connections (data_plane.h): the listening socket, accepting and dialling,
// one reader thread per connection that cuts the byte stream into frames (handle_frame takes
// each), the unproven-connection rules (slots, deadlines), and deliver(), which writes a
// batch's outputs one write per connection. Why its own file: socket lifetimes and threads,
// not sessions or compute.
#include "data_plane.h"

#include "data_plane_wire.h"
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
using namespace data_wire;  // the data plane's own helpers

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
      unproven_frame_bytes_(std::min(limits.unproven_frame_bytes, limits.max_frame_bytes)),
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
                const uint32_t size =
                    announced_bytes(reinterpret_cast<const unsigned char *>(buffer.data() + start));
                const bool proven = conn->proven.load();
                const size_t limit = proven ? max_frame_bytes_ : unproven_frame_bytes_;
                if (size > limit) {
                    post_arrived(arrived);
                    const std::string notice = notice_frame(
                        "", "data plane: a frame of " + std::to_string(size) + " bytes is over the limit of " +
                                std::to_string(limit) + (proven ? "" : " on a connection no frame has proven") +
                                "; closing the connection");
                    if (!proven) {
                        const uint64_t refused = ++unproven_refused_;
                        if ((refused & (refused - 1)) == 0) {  // 1, 2, 4, ...: a flood cannot fill the log
                            std::fprintf(stderr,
                                         "baton-worker: data plane: an unproven connection announced a frame of %u "
                                         "bytes, over the %zu bytes allowed before a frame opens; closed (%llu so "
                                         "far)\n",
                                         size, limit, static_cast<unsigned long long>(refused));
                        }
                    }
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
            // an unproven connection's buffer never holds more than the frame it may announce
            const size_t limit = conn->proven.load() ? max_frame_bytes_ : unproven_frame_bytes_;
            const ssize_t got = ::read(conn->fd, chunk, read_allowance(buffer.size(), limit, sizeof(chunk)));
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

void DataPlaneServer::connection_ended(const Connection * conn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto & [sid, s] : sessions_) {
        if (s.source == conn) {
            s.source = nullptr;
            engine_.peer_lost(s.generation);
        }
    }
}

void DataPlaneServer::deliver(std::vector<Outgoing> & outgoing) {
    // The frames for one connection go in one write, in the Forward's order: the receiver
    // reads them together and computes them in one Forward (sent one by one, the first would
    // often start a Forward alone while the rest are still arriving).
    std::vector<std::pair<std::shared_ptr<Connection>, std::string>> to_owners;
    std::vector<std::pair<std::string, std::string>> to_hops;  // ("host:port", frames)
    // the sessions of each hop's STEPs ("host:port" -> (id, generation)): a new connection's HELLOs
    std::unordered_map<std::string, std::vector<std::pair<std::string, uint64_t>>> stepping;
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
            auto & sessions = stepping[address];
            if (!o.continued && std::find(sessions.begin(), sessions.end(),
                                          std::make_pair(o.session_id, o.generation)) == sessions.end()) {
                sessions.emplace_back(o.session_id, o.generation);
            }
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
            // a connection this worker dialled proves itself before its first rows arrive (it is
            // unproven at the receiver, which takes only short frames until one opens)
            bool greeted = false;
            {
                std::lock_guard<std::mutex> lock(conn->send_mu);
                greeted = conn->hello_sent;
            }
            std::string first;  // HELLOs, then the frames: one write still
            if (!greeted) {
                first = hello_frames(stepping[address]);
                if (!first.empty()) {
                    first += frames;
                }
            }
            std::lock_guard<std::mutex> lock(conn->send_mu);
            const std::string & out = first.empty() ? frames : first;
            sent = write_full(conn->fd, out.data(), out.size());
            conn->hello_sent = conn->hello_sent || (sent && !first.empty());
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
