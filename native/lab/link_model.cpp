// The emulated WAN's rules (link_model.h): pure functions of their inputs.
#include "link_model.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace baton::lab {

int64_t default_queue_bytes(int64_t rate_bps) {
    const int64_t quarter_second = rate_bps / 8 / 4;
    return std::max<int64_t>(64 * 1024, quarter_second);
}

namespace {

int64_t transmit_ns(size_t bytes, int64_t rate_bps) {
    // bytes * 8 bits at rate_bps, rounded up; __int128 keeps a slow link's long packets exact
    const __int128 bits_ns = static_cast<__int128>(bytes) * 8 * kNsPerSecond;
    return static_cast<int64_t>((bits_ns + rate_bps - 1) / rate_bps);
}

}  // namespace

int64_t Serializer::backlog_bytes(int64_t now_ns, int64_t rate_bps) const {
    if (rate_bps <= 0 || free_at_ns_ <= now_ns) {
        return 0;
    }
    const __int128 bits = static_cast<__int128>(free_at_ns_ - now_ns) * rate_bps / kNsPerSecond;
    return static_cast<int64_t>(bits / 8);
}

std::optional<int64_t> Serializer::offer(int64_t now_ns, size_t bytes, int64_t rate_bps, int64_t queue_bytes) {
    if (rate_bps <= 0) {
        return now_ns;
    }
    const int64_t limit = queue_bytes > 0 ? queue_bytes : default_queue_bytes(rate_bps);
    const int64_t waiting = backlog_bytes(now_ns, rate_bps);
    if (waiting > 0 && waiting + static_cast<int64_t>(bytes) > limit) {
        return std::nullopt;
    }
    const int64_t start_ns = std::max(now_ns, free_at_ns_);
    free_at_ns_ = start_ns + transmit_ns(bytes, rate_bps);
    return free_at_ns_;
}

LinkOutcome DirectedLink::send(int64_t now_ns, size_t bytes, double loss_draw, double jitter_draw) {
    if (!settings.up) {
        return {Verdict::drop_down, 0};
    }
    if (loss_draw < settings.loss) {
        return {Verdict::drop_loss, 0};
    }
    const auto departed = serializer_.offer(now_ns, bytes, settings.rate_bps, settings.queue_bytes);
    if (!departed) {
        return {Verdict::drop_queue, 0};
    }
    const double jitter = (2.0 * jitter_draw - 1.0) * static_cast<double>(settings.jitter_ns);
    const int64_t delay_ns = std::max<int64_t>(0, settings.delay_ns + static_cast<int64_t>(std::llround(jitter)));
    const int64_t arrive_ns = std::max(*departed + delay_ns, last_arrive_ns_);
    last_arrive_ns_ = arrive_ns;
    return {Verdict::deliver, arrive_ns};
}

// --- IPv4 -----------------------------------------------------------------------------------

std::optional<PacketInfo> parse_ipv4(const uint8_t * p, size_t size) {
    if (size < 20 || (p[0] >> 4) != 4) {
        return std::nullopt;
    }
    const size_t header = static_cast<size_t>(p[0] & 0x0f) * 4;
    const size_t total = (static_cast<size_t>(p[2]) << 8) | p[3];
    if (header < 20 || header > size || total < header || total > size) {
        return std::nullopt;
    }
    PacketInfo info;
    info.protocol = p[9];
    info.src = (uint32_t(p[12]) << 24) | (uint32_t(p[13]) << 16) | (uint32_t(p[14]) << 8) | p[15];
    info.dst = (uint32_t(p[16]) << 24) | (uint32_t(p[17]) << 16) | (uint32_t(p[18]) << 8) | p[19];
    const uint16_t fragment_offset = static_cast<uint16_t>(((p[6] & 0x1f) << 8) | p[7]);
    if (fragment_offset != 0) {
        info.later_fragment = true;
        return info;
    }
    const uint8_t * l4 = p + header;
    const size_t l4_size = total - header;
    if (info.protocol == kTcp || info.protocol == kUdp) {
        if (l4_size < 4) {
            return std::nullopt;
        }
        info.src_port = static_cast<uint16_t>((l4[0] << 8) | l4[1]);
        info.dst_port = static_cast<uint16_t>((l4[2] << 8) | l4[3]);
    } else if (info.protocol == kIcmp) {
        if (l4_size < 8) {
            return std::nullopt;
        }
        const uint8_t type = l4[0];
        if (type == 8 || type == 0) {  // echo request / reply: the identifier names the flow
            const uint16_t id = static_cast<uint16_t>((l4[4] << 8) | l4[5]);
            info.src_port = id;
            info.dst_port = id;
        }
    }
    return info;
}

std::optional<uint32_t> parse_address(const std::string & dotted) {
    uint32_t address = 0;
    int parts = 0;
    size_t i = 0;
    while (i <= dotted.size()) {
        size_t j = dotted.find('.', i);
        if (j == std::string::npos) {
            j = dotted.size();
        }
        const std::string part = dotted.substr(i, j - i);
        if (part.empty() || part.size() > 3 || part.find_first_not_of("0123456789") != std::string::npos) {
            return std::nullopt;
        }
        const int value = std::atoi(part.c_str());
        if (value > 255) {
            return std::nullopt;
        }
        address = (address << 8) | static_cast<uint32_t>(value);
        ++parts;
        i = j + 1;
    }
    if (parts != 4) {
        return std::nullopt;
    }
    return address;
}

std::string format_address(uint32_t a) {
    return std::to_string(a >> 24) + "." + std::to_string((a >> 16) & 0xff) + "." + std::to_string((a >> 8) & 0xff) +
           "." + std::to_string(a & 0xff);
}

bool in_lab_range(uint32_t address) {
    return (address & 0xfffe0000u) == 0xc6120000u;  // 198.18.0.0/15
}

// --- the filter -------------------------------------------------------------------------------

void FlowFilter::outbound(int64_t now_ns, const PacketInfo & info) {
    if (info.later_fragment) {
        return;  // its first fragment opened the flow
    }
    last_seen_ns_[Key{info.protocol, info.src_port, info.dst, info.dst_port}] = now_ns;
}

bool FlowFilter::allows_inbound(int64_t now_ns, const PacketInfo & info) const {
    if (info.later_fragment) {
        // no ports: pass when the machine has any live flow with that address
        for (const auto & [key, seen_ns] : last_seen_ns_) {
            if (std::get<0>(key) == info.protocol && std::get<2>(key) == info.src && now_ns - seen_ns <= idle_timeout_ns_) {
                return true;
            }
        }
        return false;
    }
    const auto it = last_seen_ns_.find(Key{info.protocol, info.dst_port, info.src, info.src_port});
    return it != last_seen_ns_.end() && now_ns - it->second <= idle_timeout_ns_;
}

size_t FlowFilter::expire(int64_t now_ns) {
    size_t gone = 0;
    for (auto it = last_seen_ns_.begin(); it != last_seen_ns_.end();) {
        if (now_ns - it->second > idle_timeout_ns_) {
            it = last_seen_ns_.erase(it);
            ++gone;
        } else {
            ++it;
        }
    }
    return gone;
}

// --- control commands ------------------------------------------------------------------------

namespace {

bool parse_int(const std::string & text, int64_t lo, int64_t hi, int64_t & out) {
    if (text.empty()) {
        return false;
    }
    errno = 0;
    char * end = nullptr;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0 || end == nullptr || *end != '\0' || value < lo || value > hi) {
        return false;
    }
    out = value;
    return true;
}

bool parse_machine(const std::string & text, int machines, int & out) {
    int64_t value = 0;
    if (!parse_int(text, 0, machines - 1, value)) {
        return false;
    }
    out = static_cast<int>(value);
    return true;
}

constexpr int64_t kMaxDelayUs = 60LL * 1000 * 1000;        // a minute, one way
constexpr int64_t kMaxRateBps = 100LL * 1000 * 1000 * 1000; // 100 Gbit/s
constexpr int64_t kMaxQueueBytes = 1LL << 30;

}  // namespace

std::optional<Command> parse_command(const std::string & line, int machines, std::string & error) {
    std::istringstream words(line);
    std::vector<std::string> tokens;
    for (std::string word; words >> word;) {
        tokens.push_back(word);
    }
    if (tokens.empty()) {
        error = "empty command";
        return std::nullopt;
    }
    Command command;
    const std::string & verb = tokens[0];
    size_t first_field = 1;
    if (verb == "ping" || verb == "stats") {
        command.kind = verb == "ping" ? Command::ping : Command::stats;
        if (tokens.size() != 1) {
            error = verb + " takes no arguments";
            return std::nullopt;
        }
        return command;
    }
    if (verb == "link") {
        command.kind = Command::link;
        if (tokens.size() < 3 || !parse_machine(tokens[1], machines, command.a) ||
            !parse_machine(tokens[2], machines, command.b) || command.a == command.b) {
            error = "link needs two different machine indexes below " + std::to_string(machines);
            return std::nullopt;
        }
        first_field = 3;
    } else if (verb == "access") {
        command.kind = Command::access;
        if (tokens.size() < 2 || !parse_machine(tokens[1], machines, command.a)) {
            error = "access needs a machine index below " + std::to_string(machines);
            return std::nullopt;
        }
        first_field = 2;
    } else if (verb == "nat") {
        command.kind = Command::nat;
        if (tokens.size() != 3 || !parse_machine(tokens[1], machines, command.a) ||
            (tokens[2] != "on" && tokens[2] != "off")) {
            error = "nat needs a machine index below " + std::to_string(machines) + " and on or off";
            return std::nullopt;
        }
        command.nat_on = tokens[2] == "on";
        return command;
    } else {
        error = "unknown command '" + verb + "' (link, access, nat, stats, ping)";
        return std::nullopt;
    }
    for (size_t i = first_field; i < tokens.size(); ++i) {
        const size_t eq = tokens[i].find('=');
        if (eq == std::string::npos || eq == 0) {
            error = "'" + tokens[i] + "' is not key=value";
            return std::nullopt;
        }
        command.fields[tokens[i].substr(0, eq)] = tokens[i].substr(eq + 1);
    }
    return command;
}

bool apply_link_fields(const std::map<std::string, std::string> & fields, LinkSettings & settings, std::string & error) {
    LinkSettings next = settings;
    for (const auto & [key, value] : fields) {
        int64_t n = 0;
        if (key == "delay_us" && parse_int(value, 0, kMaxDelayUs, n)) {
            next.delay_ns = n * 1000;
        } else if (key == "jitter_us" && parse_int(value, 0, kMaxDelayUs, n)) {
            next.jitter_ns = n * 1000;
        } else if (key == "rate_bps" && parse_int(value, 0, kMaxRateBps, n)) {
            next.rate_bps = n;
        } else if (key == "queue_bytes" && parse_int(value, 0, kMaxQueueBytes, n)) {
            next.queue_bytes = n;
        } else if (key == "up" && parse_int(value, 0, 1, n)) {
            next.up = n == 1;
        } else if (key == "loss") {
            char * end = nullptr;
            const double p = std::strtod(value.c_str(), &end);
            if (value.empty() || end == nullptr || *end != '\0' || !(p >= 0.0 && p <= 1.0)) {
                error = "loss=" + value + ": a probability from 0 to 1";
                return false;
            }
            next.loss = p;
        } else {
            error = "bad link field " + key + "=" + value +
                    " (delay_us, jitter_us: 0-60000000; rate_bps 0-1e11; queue_bytes 0-2^30; loss 0-1; up 0|1)";
            return false;
        }
    }
    settings = next;
    return true;
}

bool apply_access_fields(const std::map<std::string, std::string> & fields, AccessSettings & settings, std::string & error) {
    AccessSettings next = settings;
    for (const auto & [key, value] : fields) {
        int64_t n = 0;
        if (key == "uplink_bps" && parse_int(value, 0, kMaxRateBps, n)) {
            next.uplink_bps = n;
        } else if (key == "downlink_bps" && parse_int(value, 0, kMaxRateBps, n)) {
            next.downlink_bps = n;
        } else if (key == "queue_bytes" && parse_int(value, 0, kMaxQueueBytes, n)) {
            next.queue_bytes = n;
        } else {
            error = "bad access field " + key + "=" + value + " (uplink_bps, downlink_bps: 0-1e11; queue_bytes 0-2^30)";
            return false;
        }
    }
    settings = next;
    return true;
}

}  // namespace baton::lab
