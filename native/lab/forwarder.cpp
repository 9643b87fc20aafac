// baton-lab-forwarder: the emulated WAN's one forwarding process (the kernel here has no netem).
//
//   baton-lab-forwarder --control PATH --tun FD=ADDRESS [--tun FD=ADDRESS ...] [--seed N]
//                       [--parent-pid PID] [--lifeline-fd FD] [--nat-timeout-s S] [--max-held-bytes N]
//
// Each --tun is an open TUN device (IFF_TUN | IFF_NO_PI) that the caller has moved into one
// lab machine's network namespace, where it routes 198.18.0.0/15; ADDRESS is that machine's
// address, and the order of the flags is the machines' order (index 0, 1, ...). Every IPv4
// packet a machine sends comes out of its TUN here, passes the rules of link_model.h (its
// uplink, the link to the destination, the destination's NAT-like filter and downlink) and is
// written into the destination's TUN at the time they name. Nothing is ever written anywhere
// but the lab's own TUNs: a packet to an address that is not a lab machine's is dropped.
//
// Control: a Unix stream socket at PATH (mode 0600), one command a line, one answer a line
// ("ok", "pong", a JSON object for "stats", or "error: ..."); see link_model.h Command.
//
// Lifetime: exits on SIGTERM or SIGINT, and with its parent: --lifeline-fd is the read end of a
// pipe whose write end only the parent holds (end of file: the parent process is gone, by any
// signal, whichever of its threads started us); --parent-pid arms PR_SET_PDEATHSIG as well.
// Non-persistent TUN devices vanish with their last file descriptor, so the lab's links go with
// this process.
#include "link_model.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace baton::lab;

volatile std::sig_atomic_t g_stop = 0;

void on_stop_signal(int) { g_stop = 1; }

int64_t now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * kNsPerSecond + ts.tv_nsec;
}

struct LinkCounters {
    uint64_t packets = 0, bytes = 0, delivered = 0, delivered_bytes = 0;
    uint64_t drop_loss = 0, drop_down = 0, drop_queue = 0;
};

struct Machine {
    int fd = -1;
    uint32_t address = 0;
    AccessSettings access;
    Serializer uplink;
    Serializer downlink;
    bool nat = false;
    FlowFilter filter{0};
    uint64_t uplink_drops = 0, downlink_drops = 0, nat_drops = 0, spoofed = 0, unknown_dst = 0, write_errors = 0;
    // time packets spent on the shaped access links (queued and sent at the rate): what a test
    // reads to know a rate was met, where comparing two wall times would be noise
    int64_t uplink_wait_ns = 0, downlink_wait_ns = 0;
};

struct Event {
    int64_t at_ns;
    uint64_t seq;
    int dst;
    bool at_downlink;  // true: reaches the destination's filter and downlink; false: written
    PacketInfo info;
    std::string packet;
};

struct Later {
    bool operator()(const Event & x, const Event & y) const {
        return x.at_ns != y.at_ns ? x.at_ns > y.at_ns : x.seq > y.seq;
    }
};

struct ControlClient {
    int fd;
    std::string in;
};

class Forwarder final {
public:
    Forwarder(std::vector<Machine> machines, uint64_t seed, int64_t nat_timeout_ns, int64_t max_held_bytes)
        : machines_(std::move(machines)),
          links_(machines_.size() * machines_.size()),
          counters_(machines_.size() * machines_.size()),
          rng_(seed),
          nat_timeout_ns_(nat_timeout_ns),
          max_held_bytes_(max_held_bytes) {
        for (size_t i = 0; i < machines_.size(); ++i) {
            by_address_[machines_[i].address] = static_cast<int>(i);
            machines_[i].filter = FlowFilter(nat_timeout_ns_);
        }
    }

    int run(const std::string & control_path, int lifeline_fd);

private:
    DirectedLink & link(int a, int b) { return links_[static_cast<size_t>(a) * machines_.size() + b]; }
    LinkCounters & counters(int a, int b) { return counters_[static_cast<size_t>(a) * machines_.size() + b]; }
    double draw() { return uniform_(rng_); }

    void receive(int from, std::string packet, int64_t now);
    void handle(Event event, int64_t now);
    void schedule(Event event);
    bool read_tun(int index, int64_t now);
    void serve_control_line(ControlClient & client, const std::string & line);
    std::string stats_json();

    std::vector<Machine> machines_;
    std::vector<DirectedLink> links_;
    std::vector<LinkCounters> counters_;
    std::map<uint32_t, int> by_address_;
    std::vector<Event> heap_;
    uint64_t next_seq_ = 0;
    std::mt19937_64 rng_;
    std::uniform_real_distribution<double> uniform_{0.0, 1.0};
    int64_t nat_timeout_ns_;
    int64_t max_held_bytes_;
    int64_t held_bytes_ = 0;
    int64_t peak_held_bytes_ = 0;
    uint64_t non_ipv4_ = 0, held_drops_ = 0, packets_ = 0;
};

void Forwarder::schedule(Event event) {
    held_bytes_ += static_cast<int64_t>(event.packet.size());
    peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
    heap_.push_back(std::move(event));
    std::push_heap(heap_.begin(), heap_.end(), Later{});
}

void Forwarder::receive(int from, std::string packet, int64_t now) {
    ++packets_;
    const auto info = parse_ipv4(reinterpret_cast<const uint8_t *>(packet.data()), packet.size());
    if (!info) {
        ++non_ipv4_;  // IPv6 neighbour discovery and the like: the lab speaks IPv4 only
        return;
    }
    Machine & source = machines_[from];
    if (info->src != source.address) {
        ++source.spoofed;
        return;
    }
    const auto found = by_address_.find(info->dst);
    if (found == by_address_.end()) {
        ++source.unknown_dst;
        return;
    }
    const int to = found->second;
    if (to == from) {
        return;  // the kernel routes a machine's own address over lo, never here
    }
    if (held_bytes_ + static_cast<int64_t>(packet.size()) > max_held_bytes_) {
        ++held_drops_;
        return;
    }
    if (source.nat) {
        source.filter.outbound(now, *info);
    }
    LinkCounters & count = counters(from, to);
    ++count.packets;
    count.bytes += packet.size();
    const auto sent = source.uplink.offer(now, packet.size(), source.access.uplink_bps, source.access.queue_bytes);
    if (!sent) {
        ++source.uplink_drops;
        return;
    }
    source.uplink_wait_ns += *sent - now;
    const double loss_draw = draw();
    const double jitter_draw = draw();
    const LinkOutcome outcome = link(from, to).send(*sent, packet.size(), loss_draw, jitter_draw);
    switch (outcome.verdict) {
        case Verdict::drop_loss: ++count.drop_loss; return;
        case Verdict::drop_down: ++count.drop_down; return;
        case Verdict::drop_queue: ++count.drop_queue; return;
        case Verdict::deliver: break;
    }
    schedule(Event{outcome.arrive_ns, next_seq_++, to, true, *info, std::move(packet)});
}

void Forwarder::handle(Event event, int64_t now) {
    Machine & target = machines_[event.dst];
    if (event.at_downlink) {
        if (target.nat && !target.filter.allows_inbound(event.at_ns, event.info)) {
            ++target.nat_drops;
            return;
        }
        const auto out = target.downlink.offer(event.at_ns, event.packet.size(), target.access.downlink_bps,
                                               target.access.queue_bytes);
        if (!out) {
            ++target.downlink_drops;
            return;
        }
        target.downlink_wait_ns += *out - event.at_ns;
        if (*out > now) {
            event.at_ns = *out;
            event.at_downlink = false;
            schedule(std::move(event));
            return;
        }
    }
    const int from = by_address_[event.info.src];
    if (write(target.fd, event.packet.data(), event.packet.size()) < 0) {
        ++target.write_errors;
        return;
    }
    LinkCounters & count = counters(from, event.dst);
    ++count.delivered;
    count.delivered_bytes += event.packet.size();
}

bool Forwarder::read_tun(int index, int64_t now) {
    // at most a burst per wake-up, so one busy machine cannot hold back the rest
    char buffer[65536];
    for (int burst = 0; burst < 64; ++burst) {
        const ssize_t n = read(machines_[index].fd, buffer, sizeof buffer);
        if (n < 0) {
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        }
        if (n == 0) {
            return false;
        }
        receive(index, std::string(buffer, static_cast<size_t>(n)), now);
    }
    return true;
}

std::string Forwarder::stats_json() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    std::string out = "{\"links\":[";
    bool first = true;
    for (size_t a = 0; a < machines_.size(); ++a) {
        for (size_t b = 0; b < machines_.size(); ++b) {
            if (a == b) {
                continue;
            }
            const LinkCounters & c = counters(static_cast<int>(a), static_cast<int>(b));
            const LinkSettings & s = link(static_cast<int>(a), static_cast<int>(b)).settings;
            char row[512];
            std::snprintf(row, sizeof row,
                          "%s{\"src\":%zu,\"dst\":%zu,\"packets\":%llu,\"bytes\":%llu,\"delivered\":%llu,"
                          "\"delivered_bytes\":%llu,\"drop_loss\":%llu,\"drop_down\":%llu,\"drop_queue\":%llu,"
                          "\"delay_us\":%lld,\"jitter_us\":%lld,\"loss\":%.6g,\"rate_bps\":%lld,\"up\":%s}",
                          first ? "" : ",", a, b, (unsigned long long)c.packets, (unsigned long long)c.bytes,
                          (unsigned long long)c.delivered, (unsigned long long)c.delivered_bytes,
                          (unsigned long long)c.drop_loss, (unsigned long long)c.drop_down,
                          (unsigned long long)c.drop_queue, (long long)(s.delay_ns / 1000),
                          (long long)(s.jitter_ns / 1000), s.loss, (long long)s.rate_bps, s.up ? "true" : "false");
            out += row;
            first = false;
        }
    }
    out += "],\"machines\":[";
    for (size_t i = 0; i < machines_.size(); ++i) {
        const Machine & m = machines_[i];
        char row[512];
        std::snprintf(row, sizeof row,
                      "%s{\"index\":%zu,\"address\":\"%s\",\"nat\":%s,\"nat_flows\":%zu,\"nat_drops\":%llu,"
                      "\"uplink_drops\":%llu,\"downlink_drops\":%llu,\"spoofed\":%llu,\"unknown_dst\":%llu,"
                      "\"write_errors\":%llu,\"uplink_bps\":%lld,\"downlink_bps\":%lld,\"uplink_wait_us\":%lld,"
                      "\"downlink_wait_us\":%lld}",
                      i ? "," : "", i, format_address(m.address).c_str(), m.nat ? "true" : "false", m.filter.flows(),
                      (unsigned long long)m.nat_drops, (unsigned long long)m.uplink_drops,
                      (unsigned long long)m.downlink_drops, (unsigned long long)m.spoofed,
                      (unsigned long long)m.unknown_dst, (unsigned long long)m.write_errors,
                      (long long)m.access.uplink_bps, (long long)m.access.downlink_bps,
                      (long long)(m.uplink_wait_ns / 1000), (long long)(m.downlink_wait_ns / 1000));
        out += row;
    }
    char tail[384];
    std::snprintf(tail, sizeof tail,
                  "],\"packets\":%llu,\"non_ipv4\":%llu,\"held_drops\":%llu,\"held_bytes\":%lld,"
                  "\"peak_held_bytes\":%lld,\"cpu_user_s\":%.6f,\"cpu_system_s\":%.6f}",
                  (unsigned long long)packets_, (unsigned long long)non_ipv4_, (unsigned long long)held_drops_,
                  (long long)held_bytes_, (long long)peak_held_bytes_,
                  usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6, usage.ru_stime.tv_sec + usage.ru_stime.tv_usec / 1e6);
    out += tail;
    return out;
}

void Forwarder::serve_control_line(ControlClient & client, const std::string & line) {
    std::string error;
    std::string answer = "ok";
    const auto command = parse_command(line, static_cast<int>(machines_.size()), error);
    if (!command) {
        answer = "error: " + error;
    } else {
        switch (command->kind) {
            case Command::ping: answer = "pong"; break;
            case Command::stats: answer = stats_json(); break;
            case Command::link:
                if (!apply_link_fields(command->fields, link(command->a, command->b).settings, error)) {
                    answer = "error: " + error;
                }
                break;
            case Command::access:
                if (!apply_access_fields(command->fields, machines_[command->a].access, error)) {
                    answer = "error: " + error;
                }
                break;
            case Command::nat:
                machines_[command->a].nat = command->nat_on;
                if (!command->nat_on) {
                    machines_[command->a].filter = FlowFilter(nat_timeout_ns_);
                }
                break;
        }
    }
    answer += '\n';
    // answers are small and the client waits for each: a blocking-enough write
    size_t done = 0;
    while (done < answer.size()) {
        const ssize_t n = send(client.fd, answer.data() + done, answer.size() - done, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return;
        }
        done += static_cast<size_t>(n);
    }
}

int Forwarder::run(const std::string & control_path, int lifeline_fd) {
    const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (listener < 0 || control_path.size() >= sizeof addr.sun_path) {
        std::fprintf(stderr, "baton-lab-forwarder: cannot make the control socket %s\n", control_path.c_str());
        return 1;
    }
    std::strcpy(addr.sun_path, control_path.c_str());
    unlink(control_path.c_str());
    const mode_t old_mask = umask(077);  // owner-only from the start
    const int bound = bind(listener, reinterpret_cast<sockaddr *>(&addr), sizeof addr);
    umask(old_mask);
    if (bound != 0 || listen(listener, 16) != 0) {
        std::fprintf(stderr, "baton-lab-forwarder: control socket %s: %s\n", control_path.c_str(), std::strerror(errno));
        return 1;
    }
    const int ep = epoll_create1(EPOLL_CLOEXEC);
    const auto watch = [ep](int fd, uint64_t tag) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = tag;
        return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0;
    };
    constexpr uint64_t kListenerTag = 1ULL << 40;
    constexpr uint64_t kClientTag = 1ULL << 41;
    for (size_t i = 0; i < machines_.size(); ++i) {
        fcntl(machines_[i].fd, F_SETFL, fcntl(machines_[i].fd, F_GETFL) | O_NONBLOCK);
        if (!watch(machines_[i].fd, i)) {
            std::fprintf(stderr, "baton-lab-forwarder: tun fd %d: %s\n", machines_[i].fd, std::strerror(errno));
            return 1;
        }
    }
    watch(listener, kListenerTag);
    constexpr uint64_t kLifelineTag = 1ULL << 42;
    if (lifeline_fd >= 0 && !watch(lifeline_fd, kLifelineTag)) {
        std::fprintf(stderr, "baton-lab-forwarder: lifeline fd %d: %s\n", lifeline_fd, std::strerror(errno));
        return 1;
    }
    std::map<int, ControlClient> clients;
    std::fprintf(stderr, "baton-lab-forwarder: %zu machines, control %s\n", machines_.size(), control_path.c_str());
    int64_t next_expiry_ns = now_ns() + kNsPerSecond;
    epoll_event ready[64];
    while (!g_stop) {
        int64_t now = now_ns();
        while (!heap_.empty() && heap_.front().at_ns <= now) {
            std::pop_heap(heap_.begin(), heap_.end(), Later{});
            Event event = std::move(heap_.back());
            heap_.pop_back();
            held_bytes_ -= static_cast<int64_t>(event.packet.size());
            handle(std::move(event), now);
        }
        if (now >= next_expiry_ns) {
            for (Machine & m : machines_) {
                m.filter.expire(now);
            }
            next_expiry_ns = now + kNsPerSecond;
        }
        timespec timeout{};
        timespec * wait = nullptr;
        const int64_t until = heap_.empty() ? next_expiry_ns : std::min(heap_.front().at_ns, next_expiry_ns);
        const int64_t delay = std::max<int64_t>(0, until - now);
        timeout.tv_sec = delay / kNsPerSecond;
        timeout.tv_nsec = delay % kNsPerSecond;
        wait = &timeout;
        const int n = epoll_pwait2(ep, ready, 64, wait, nullptr);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            std::perror("baton-lab-forwarder: epoll_pwait2");
            return 1;
        }
        now = now_ns();
        for (int k = 0; k < n; ++k) {
            const uint64_t tag = ready[k].data.u64;
            if (tag < machines_.size()) {
                if (!read_tun(static_cast<int>(tag), now)) {
                    std::fprintf(stderr, "baton-lab-forwarder: machine %llu's tun failed: %s\n",
                                 (unsigned long long)tag, std::strerror(errno));
                    return 1;
                }
            } else if (tag == kLifelineTag) {
                char byte;
                if (read(lifeline_fd, &byte, 1) <= 0) {
                    g_stop = 1;  // the parent is gone
                }
            } else if (tag == kListenerTag) {
                const int fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd >= 0) {
                    clients[fd] = ControlClient{fd, {}};
                    watch(fd, kClientTag | static_cast<uint64_t>(fd));
                }
            } else {
                const int fd = static_cast<int>(tag & 0xffffffffu);
                auto it = clients.find(fd);
                if (it == clients.end()) {
                    continue;
                }
                char buffer[4096];
                const ssize_t got = recv(fd, buffer, sizeof buffer, 0);
                bool closed = got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR);
                if (got > 0) {
                    it->second.in.append(buffer, static_cast<size_t>(got));
                    size_t eol;
                    while ((eol = it->second.in.find('\n')) != std::string::npos) {
                        const std::string line = it->second.in.substr(0, eol);
                        it->second.in.erase(0, eol + 1);
                        serve_control_line(it->second, line);
                    }
                    if (it->second.in.size() > 4096) {
                        closed = true;  // no command is that long
                    }
                }
                if (closed) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
                    close(fd);
                    clients.erase(it);
                }
            }
        }
    }
    unlink(control_path.c_str());
    return 0;
}

[[noreturn]] void usage(const char * why) {
    std::fprintf(stderr,
                 "baton-lab-forwarder: %s\nusage: baton-lab-forwarder --control PATH --tun FD=ADDRESS [--tun ...]"
                 " [--seed N] [--parent-pid PID] [--lifeline-fd FD] [--nat-timeout-s S] [--max-held-bytes N]\n",
                 why);
    std::exit(2);
}

}  // namespace

int main(int argc, char ** argv) {
    std::string control;
    std::vector<Machine> machines;
    uint64_t seed = 1;
    long parent_pid = 0;
    int lifeline_fd = -1;
    int64_t nat_timeout_s = 120;
    int64_t max_held_bytes = 256LL * 1024 * 1024;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (i + 1 >= argc) {
            usage(("missing value for " + flag).c_str());
        }
        const std::string value = argv[++i];
        if (flag == "--control") {
            control = value;
        } else if (flag == "--tun") {
            const size_t eq = value.find('=');
            const auto address = eq == std::string::npos ? std::nullopt : parse_address(value.substr(eq + 1));
            if (!address || !in_lab_range(*address)) {
                usage(("--tun " + value + ": want FD=ADDRESS with ADDRESS in 198.18.0.0/15").c_str());
            }
            Machine m;
            m.fd = std::atoi(value.substr(0, eq).c_str());
            m.address = *address;
            machines.push_back(std::move(m));
        } else if (flag == "--seed") {
            seed = std::strtoull(value.c_str(), nullptr, 10);
        } else if (flag == "--parent-pid") {
            parent_pid = std::strtol(value.c_str(), nullptr, 10);
        } else if (flag == "--lifeline-fd") {
            lifeline_fd = std::atoi(value.c_str());
        } else if (flag == "--nat-timeout-s") {
            nat_timeout_s = std::strtoll(value.c_str(), nullptr, 10);
        } else if (flag == "--max-held-bytes") {
            max_held_bytes = std::strtoll(value.c_str(), nullptr, 10);
        } else {
            usage(("unknown flag " + flag).c_str());
        }
    }
    if (control.empty() || machines.size() < 2 || nat_timeout_s <= 0 || max_held_bytes <= 0) {
        usage("want --control and at least two --tun");
    }
    if (parent_pid > 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent_pid) {
            return 1;  // the parent is already gone
        }
    }
    prctl(PR_SET_TIMERSLACK, 1UL);  // wake-ups within a microsecond of a packet's time
    std::signal(SIGPIPE, SIG_IGN);
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGINT, on_stop_signal);
    Forwarder forwarder(std::move(machines), seed, nat_timeout_s * kNsPerSecond, max_held_bytes);
    return forwarder.run(control, lifeline_fd);
}
