// The emulated WAN's rules, with no I/O and no clock: what happens to one IPv4 packet that a lab
// machine sends (dropped, and why, or delivered at which time), and the NAT-like stateful filter.
//
// Time is passed in (nanoseconds on any monotonic scale) and so are the random draws, so every
// rule is tested on a fake clock (native/lab/lab_tests.cpp). The forwarder (forwarder.cpp)
// reads packets from the machines' TUN devices, asks these rules, and writes what they let
// through at the time they name.
//
// A packet from machine A to machine B crosses, in order:
//   A's uplink   (a serializer: rate, bounded queue; shared by all of A's links)
//   the link A->B (a serializer of its own, then one-way delay + jitter, loss, up/down)
//   B's downlink (a serializer shared by all links into B)
// Jitter never reorders a link: a packet is never delivered before the one sent before it on
// the same link (netem's "delay D J" reorders, which real paths rarely do and which makes TCP
// retransmit spuriously; a queue that keeps order is what a home link behind one modem does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace baton::lab {

constexpr int64_t kNsPerSecond = 1000000000;

// What a link (one direction) does to packets.
struct LinkSettings {
    int64_t delay_ns = 0;      // one-way
    int64_t jitter_ns = 0;     // each packet's delay is delay_ns + U(-jitter_ns, +jitter_ns), at least 0
    double loss = 0.0;         // probability in [0, 1] that a packet is dropped
    int64_t rate_bps = 0;      // bits per second; 0: unlimited
    int64_t queue_bytes = 0;   // most bytes waiting for the rate; 0: the default for the rate
    bool up = true;            // a cut link drops everything
};

// The queue a rate-limited serializer keeps unless told: 250 ms of its rate, at least 64 KiB
// (a home router's buffer; enough for TCP to fill the link at 100 ms RTT).
int64_t default_queue_bytes(int64_t rate_bps);

// A first-in first-out queue that sends at a fixed rate (a modem, a link's bottleneck).
class Serializer {
public:
    // When the last bit of a packet of `bytes`, offered at `now_ns`, has left; nullopt when the
    // queue is already holding its limit (tail drop). rate_bps 0: passes at once.
    std::optional<int64_t> offer(int64_t now_ns, size_t bytes, int64_t rate_bps, int64_t queue_bytes);

    // Bytes still waiting at `now_ns` (the backlog, counted as time at the rate).
    int64_t backlog_bytes(int64_t now_ns, int64_t rate_bps) const;

private:
    int64_t free_at_ns_ = 0;  // when the last accepted packet has been sent
};

enum class Verdict : uint8_t {
    deliver,
    drop_down,        // the link is cut
    drop_loss,        // the link's random loss
    drop_queue,       // a rate's queue was full
};

struct LinkOutcome {
    Verdict verdict = Verdict::deliver;
    int64_t arrive_ns = 0;  // with deliver: when the packet reaches the far end of the link
};

// One direction of a link between two machines.
class DirectedLink {
public:
    LinkSettings settings;

    // `loss_draw` and `jitter_draw` are uniform draws in [0, 1).
    LinkOutcome send(int64_t now_ns, size_t bytes, double loss_draw, double jitter_draw);

private:
    Serializer serializer_;
    int64_t last_arrive_ns_ = 0;  // keeps the link in order under jitter
};

// A machine's own access link (uplink out of it, downlink into it).
struct AccessSettings {
    int64_t uplink_bps = 0;     // 0: unlimited
    int64_t downlink_bps = 0;
    int64_t queue_bytes = 0;    // 0: the default for each rate
};

// --- IPv4 -----------------------------------------------------------------------------------

// What the rules need of a packet. ports are 0 for protocols without them; for ICMP echo
// request/reply, both ports carry the echo identifier (so a reply matches its request's flow).
struct PacketInfo {
    uint32_t src = 0;  // host byte order
    uint32_t dst = 0;
    uint8_t protocol = 0;
    uint16_t src_port = 0;
    uint16_t dst_port = 0;
    bool later_fragment = false;  // a fragment after the first: no transport header
};

constexpr uint8_t kIcmp = 1;
constexpr uint8_t kTcp = 6;
constexpr uint8_t kUdp = 17;

// nullopt for anything that is not a well-formed IPv4 packet (IPv6, truncated, bad header).
std::optional<PacketInfo> parse_ipv4(const uint8_t * packet, size_t size);

// "198.18.0.1" <-> host-order address; nullopt for anything else.
std::optional<uint32_t> parse_address(const std::string & dotted);
std::string format_address(uint32_t address);

// 198.18.0.0/15 (RFC 2544's benchmarking range): the only addresses the lab ever uses.
bool in_lab_range(uint32_t address);

// --- the NAT-like stateful filter ------------------------------------------------------------

// Inbound only on flows the machine opened: a packet into a filtered machine passes only if
// the machine sent a packet of the same protocol from the destination port to the source
// address and port within `idle_timeout_ns` (RFC 4787's address-and-port-dependent
// filtering, the strictest kind home routers use). No address is translated: a machine keeps
// its lab address, so what is tested is reachability, as hole punching meets it.
class FlowFilter {
public:
    explicit FlowFilter(int64_t idle_timeout_ns) : idle_timeout_ns_(idle_timeout_ns) {}

    // A packet the filtered machine sends (`info.src` is the machine).
    void outbound(int64_t now_ns, const PacketInfo & info);

    // Whether a packet into the filtered machine (`info.dst`) may pass.
    bool allows_inbound(int64_t now_ns, const PacketInfo & info) const;

    // Forgets flows idle longer than the timeout; returns how many went.
    size_t expire(int64_t now_ns);

    size_t flows() const { return last_seen_ns_.size(); }

private:
    // (protocol, local port, remote address, remote port)
    using Key = std::tuple<uint8_t, uint16_t, uint32_t, uint16_t>;
    std::map<Key, int64_t> last_seen_ns_;
    int64_t idle_timeout_ns_;
};

// --- control commands ------------------------------------------------------------------------

// One line of the control protocol (forwarder.cpp answers each with one line):
//   link SRC DST [delay_us=N] [jitter_us=N] [loss=P] [rate_bps=N] [queue_bytes=N] [up=0|1]
//   access M [uplink_bps=N] [downlink_bps=N] [queue_bytes=N]
//   nat M on|off
//   stats
//   ping
// SRC, DST and M are machine indexes. Fields not named keep their value.
struct Command {
    enum Kind { link, access, nat, stats, ping } kind = ping;
    int a = -1;
    int b = -1;
    std::map<std::string, std::string> fields;
    bool nat_on = false;
};

// nullopt with `error` set to what was wrong.
std::optional<Command> parse_command(const std::string & line, int machines, std::string & error);

// Applies a link command's fields to `settings`; false with `error` when a value is bad (all
// or nothing: `settings` is unchanged then).
bool apply_link_fields(const std::map<std::string, std::string> & fields, LinkSettings & settings, std::string & error);
bool apply_access_fields(const std::map<std::string, std::string> & fields, AccessSettings & settings, std::string & error);

}  // namespace baton::lab
