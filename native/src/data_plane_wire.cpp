// Framing and socket helpers of the data plane: see data_plane_wire.h.
#include "data_plane_wire.h"

#include "sealed.h"
#include "service.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace baton::data_wire {

namespace v1 = baton::worker::v1;

namespace {

constexpr int kDialTimeoutMs = 3000;
constexpr int kSendTimeoutS = 10;             // a peer that stops reading loses its connection
// TCP keepalive: a peer whose machine vanished without closing (power, network, a laptop's
// sleep) is found within ~idle + interval x count seconds, so its connection ends and frees
// its slot and thread; without it an idle connection from a gone owner or hop stays for ever.
constexpr int kKeepIdleS = 30;
constexpr int kKeepIntervalS = 10;
constexpr int kKeepCount = 3;

}  // namespace

std::string hex_of(const std::string & bytes) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out.push_back(digits[c >> 4]);
        out.push_back(digits[c & 15]);
    }
    return out;
}

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

}  // namespace baton::data_wire
