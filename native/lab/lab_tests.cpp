// The emulated WAN's rules (link_model.h) on a fake clock: times are plain numbers here.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "link_model.h"

#include <string>
#include <vector>

using namespace baton::lab;

namespace {

constexpr int64_t kUs = 1000;
constexpr int64_t kMs = 1000 * kUs;

// A minimal IPv4 packet: 20-byte header, then `l4` (ports or an ICMP header).
std::vector<uint8_t> packet(uint8_t protocol, const char * src, const char * dst, std::vector<uint8_t> l4,
                            uint16_t fragment_offset = 0) {
    std::vector<uint8_t> p(20, 0);
    p[0] = 0x45;
    const size_t total = 20 + l4.size();
    p[2] = static_cast<uint8_t>(total >> 8);
    p[3] = static_cast<uint8_t>(total);
    p[6] = static_cast<uint8_t>(fragment_offset >> 8);
    p[7] = static_cast<uint8_t>(fragment_offset);
    p[9] = protocol;
    const uint32_t s = *parse_address(src), d = *parse_address(dst);
    for (int i = 0; i < 4; ++i) {
        p[12 + i] = static_cast<uint8_t>(s >> (24 - 8 * i));
        p[16 + i] = static_cast<uint8_t>(d >> (24 - 8 * i));
    }
    p.insert(p.end(), l4.begin(), l4.end());
    return p;
}

std::vector<uint8_t> ports(uint16_t src, uint16_t dst) {
    return {uint8_t(src >> 8), uint8_t(src), uint8_t(dst >> 8), uint8_t(dst), 0, 0, 0, 0};
}

PacketInfo info_of(const std::vector<uint8_t> & p) {
    const auto info = parse_ipv4(p.data(), p.size());
    REQUIRE(info.has_value());
    return *info;
}

}  // namespace

TEST_CASE("a serializer sends at its rate, in order, and drops past its queue") {
    Serializer s;
    const int64_t rate = 8 * 1000 * 1000;  // 8 Mbit/s: one byte a microsecond
    CHECK(s.offer(0, 1000, rate, 3000) == 1000 * kUs);
    CHECK(s.offer(0, 1000, rate, 3000) == 2000 * kUs);  // behind the first
    CHECK(s.backlog_bytes(0, rate) == 2000);
    CHECK(s.offer(0, 1000, rate, 3000) == 3000 * kUs);
    CHECK_FALSE(s.offer(0, 1000, rate, 3000).has_value());  // 3000 waiting: full
    CHECK(s.offer(2500 * kUs, 1000, rate, 3000) == 4000 * kUs);  // room again as it drains
    CHECK(s.offer(10 * kMs, 500, rate, 3000) == 10 * kMs + 500 * kUs);  // idle: starts at once
    CHECK(s.offer(123, 1 << 20, 0, 0) == 123);  // no rate: no wait, no queue
}

TEST_CASE("a packet larger than the queue still passes an idle serializer") {
    Serializer s;
    CHECK(s.offer(0, 100000, 8000000, 1000).has_value());
    CHECK_FALSE(s.offer(0, 10, 8000000, 1000).has_value());
}

TEST_CASE("default queue: a quarter second of the rate, at least 64 KiB") {
    CHECK(default_queue_bytes(1000) == 64 * 1024);
    CHECK(default_queue_bytes(80LL * 1000 * 1000) == 2500 * 1000);
}

TEST_CASE("a link delays by its one-way delay, after its rate") {
    DirectedLink link;
    link.settings.delay_ns = 10 * kMs;
    LinkOutcome out = link.send(5 * kMs, 64, 0.5, 0.5);
    CHECK(out.verdict == Verdict::deliver);
    CHECK(out.arrive_ns == 15 * kMs);
    link.settings.rate_bps = 8 * 1000 * 1000;
    out = link.send(20 * kMs, 1000, 0.5, 0.5);
    CHECK(out.arrive_ns == 20 * kMs + 1000 * kUs + 10 * kMs);
}

TEST_CASE("jitter spreads the delay but never reorders a link") {
    DirectedLink link;
    link.settings.delay_ns = 10 * kMs;
    link.settings.jitter_ns = 4 * kMs;
    const LinkOutcome late = link.send(0, 64, 0.5, 0.999999);   // ~+4 ms
    CHECK(late.arrive_ns == doctest::Approx(14 * kMs).epsilon(0.001));
    const LinkOutcome early = link.send(1 * kMs, 64, 0.5, 0.0);  // would arrive at 7 ms
    CHECK(early.arrive_ns == late.arrive_ns);                    // held behind the first
    const LinkOutcome later = link.send(20 * kMs, 64, 0.5, 0.0);
    CHECK(later.arrive_ns == 26 * kMs);
    link.settings.delay_ns = 1 * kMs;  // jitter larger than the delay: never before it was sent
    const LinkOutcome floor = link.send(100 * kMs, 64, 0.5, 0.0);
    CHECK(floor.arrive_ns == 100 * kMs);
}

TEST_CASE("loss drops exactly the draws below its probability; a cut link drops all") {
    DirectedLink link;
    link.settings.loss = 0.02;
    CHECK(link.send(0, 64, 0.019, 0.5).verdict == Verdict::drop_loss);
    CHECK(link.send(0, 64, 0.02, 0.5).verdict == Verdict::deliver);
    link.settings.up = false;
    CHECK(link.send(0, 64, 0.9, 0.5).verdict == Verdict::drop_down);
    link.settings.up = true;
    CHECK(link.send(0, 64, 0.9, 0.5).verdict == Verdict::deliver);
}

TEST_CASE("a full link queue drops the packet") {
    DirectedLink link;
    link.settings.rate_bps = 8000;  // a byte a millisecond
    link.settings.queue_bytes = 100;
    CHECK(link.send(0, 80, 0.5, 0.5).verdict == Verdict::deliver);
    CHECK(link.send(0, 80, 0.5, 0.5).verdict == Verdict::drop_queue);
}

TEST_CASE("parse_ipv4 reads TCP, UDP and ICMP echo; refuses what is not IPv4") {
    const PacketInfo tcp = info_of(packet(kTcp, "198.18.0.1", "198.18.0.2", ports(40000, 7000)));
    CHECK(tcp.protocol == kTcp);
    CHECK(tcp.src == *parse_address("198.18.0.1"));
    CHECK(tcp.dst == *parse_address("198.18.0.2"));
    CHECK(tcp.src_port == 40000);
    CHECK(tcp.dst_port == 7000);
    const PacketInfo udp = info_of(packet(kUdp, "198.18.0.1", "198.18.0.2", ports(53, 5353)));
    CHECK(udp.src_port == 53);
    const PacketInfo echo = info_of(packet(kIcmp, "198.18.0.1", "198.18.0.2", {8, 0, 0, 0, 0x12, 0x34, 0, 1}));
    CHECK(echo.src_port == 0x1234);
    CHECK(echo.dst_port == 0x1234);
    const PacketInfo fragment = info_of(packet(kUdp, "198.18.0.1", "198.18.0.2", {1, 2, 3, 4}, 185));
    CHECK(fragment.later_fragment);

    std::vector<uint8_t> v6(40, 0);
    v6[0] = 0x60;
    CHECK_FALSE(parse_ipv4(v6.data(), v6.size()).has_value());
    auto truncated = packet(kTcp, "198.18.0.1", "198.18.0.2", ports(1, 2));
    CHECK_FALSE(parse_ipv4(truncated.data(), 19).has_value());
    CHECK_FALSE(parse_ipv4(truncated.data(), truncated.size() - 1).has_value());  // total length lies
    auto short_tcp = packet(kTcp, "198.18.0.1", "198.18.0.2", {1, 2});
    CHECK_FALSE(parse_ipv4(short_tcp.data(), short_tcp.size()).has_value());
}

TEST_CASE("addresses: dotted quads, and only 198.18.0.0/15 is the lab's") {
    CHECK(parse_address("198.18.0.1") == 0xc6120001u);
    CHECK(format_address(0xc6130a0bu) == "198.19.10.11");
    for (const char * bad : {"", "1.2.3", "1.2.3.4.5", "256.1.1.1", "1..2.3", "a.b.c.d", "1.2.3.4 "}) {
        CHECK_FALSE(parse_address(bad).has_value());
    }
    CHECK(in_lab_range(*parse_address("198.18.0.1")));
    CHECK(in_lab_range(*parse_address("198.19.255.254")));
    CHECK_FALSE(in_lab_range(*parse_address("198.20.0.1")));
    CHECK_FALSE(in_lab_range(*parse_address("127.0.0.1")));
    CHECK_FALSE(in_lab_range(*parse_address("10.0.0.1")));
}

TEST_CASE("the filter lets in only replies on flows the machine opened") {
    FlowFilter filter(60 * 1000 * kMs);
    const auto out = info_of(packet(kTcp, "198.18.0.3", "198.18.0.1", ports(41000, 7000)));
    const auto reply = info_of(packet(kTcp, "198.18.0.1", "198.18.0.3", ports(7000, 41000)));
    const auto other_port = info_of(packet(kTcp, "198.18.0.1", "198.18.0.3", ports(7001, 41000)));
    const auto other_host = info_of(packet(kTcp, "198.18.0.2", "198.18.0.3", ports(7000, 41000)));
    const auto udp_reply = info_of(packet(kUdp, "198.18.0.1", "198.18.0.3", ports(7000, 41000)));
    CHECK_FALSE(filter.allows_inbound(0, reply));  // unsolicited
    filter.outbound(1 * kMs, out);
    CHECK(filter.allows_inbound(2 * kMs, reply));
    CHECK_FALSE(filter.allows_inbound(2 * kMs, other_port));
    CHECK_FALSE(filter.allows_inbound(2 * kMs, other_host));
    CHECK_FALSE(filter.allows_inbound(2 * kMs, udp_reply));
    CHECK(filter.allows_inbound(60 * 1000 * kMs + 1 * kMs, reply));       // at the timeout
    CHECK_FALSE(filter.allows_inbound(60 * 1000 * kMs + 2 * kMs, reply));  // past it
    CHECK(filter.expire(60 * 1000 * kMs + 2 * kMs) == 1);
    CHECK(filter.flows() == 0);
}

TEST_CASE("two filtered machines meet by simultaneous open, not by one dialling") {
    FlowFilter a(60 * 1000 * kMs), b(60 * 1000 * kMs);
    const auto a_syn = info_of(packet(kTcp, "198.18.0.3", "198.18.0.4", ports(7100, 7200)));
    const auto b_syn = info_of(packet(kTcp, "198.18.0.4", "198.18.0.3", ports(7200, 7100)));
    a.outbound(0, a_syn);
    CHECK_FALSE(b.allows_inbound(10 * kMs, a_syn));  // B has not punched yet: dropped
    b.outbound(12 * kMs, b_syn);
    CHECK(a.allows_inbound(22 * kMs, b_syn));        // A's hole lets B's SYN in
    CHECK(b.allows_inbound(1000 * kMs, a_syn));      // A's retransmitted SYN now passes B
}

TEST_CASE("a later fragment passes when its sender is a live peer of the machine") {
    FlowFilter filter(1000 * kMs);
    const auto out = info_of(packet(kUdp, "198.18.0.3", "198.18.0.1", ports(5000, 6000)));
    const auto frag = info_of(packet(kUdp, "198.18.0.1", "198.18.0.3", {1, 2, 3, 4}, 185));
    CHECK_FALSE(filter.allows_inbound(0, frag));
    filter.outbound(0, out);
    CHECK(filter.allows_inbound(1, frag));
}

TEST_CASE("control commands: parsed, checked, applied all or nothing") {
    std::string error;
    auto link = parse_command("link 0 2 delay_us=10000 loss=0.02 rate_bps=5000000 up=0", 3, error);
    REQUIRE(link.has_value());
    CHECK(link->kind == Command::link);
    CHECK(link->a == 0);
    CHECK(link->b == 2);
    LinkSettings settings;
    CHECK(apply_link_fields(link->fields, settings, error));
    CHECK(settings.delay_ns == 10 * kMs);
    CHECK(settings.loss == doctest::Approx(0.02));
    CHECK(settings.rate_bps == 5000000);
    CHECK_FALSE(settings.up);

    LinkSettings untouched = settings;
    auto bad = parse_command("link 0 1 delay_us=5 loss=1.5", 3, error);
    REQUIRE(bad.has_value());
    CHECK_FALSE(apply_link_fields(bad->fields, settings, error));
    CHECK(error.find("loss") != std::string::npos);
    CHECK(settings.delay_ns == untouched.delay_ns);  // delay_us=5 not applied either

    for (const char * line : {"", "link 0 0", "link 0 3", "link 0", "link a 1", "nat 1 maybe", "fly 1 2",
                              "stats now", "link 0 1 delay_us"}) {
        CHECK_FALSE(parse_command(line, 3, error).has_value());
        CHECK_FALSE(error.empty());
    }
    auto unknown = parse_command("link 0 1 colour=red", 3, error);
    REQUIRE(unknown.has_value());
    CHECK_FALSE(apply_link_fields(unknown->fields, settings, error));
    CHECK_FALSE(apply_link_fields({{"delay_us", "-1"}}, settings, error));
    CHECK_FALSE(apply_link_fields({{"delay_us", "10ms"}}, settings, error));

    auto nat = parse_command("nat 2 on", 3, error);
    REQUIRE(nat.has_value());
    CHECK(nat->nat_on);
    auto access = parse_command("access 1 uplink_bps=5000000", 3, error);
    REQUIRE(access.has_value());
    AccessSettings a;
    CHECK(apply_access_fields(access->fields, a, error));
    CHECK(a.uplink_bps == 5000000);
    CHECK_FALSE(apply_access_fields({{"sideways_bps", "1"}}, a, error));
}
