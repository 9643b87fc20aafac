// baton-ping-pong: what one message between two processes costs on this machine, with no Python
// and no TLS: the floor under any data plane in which a hop is a process writing a boundary
// to the next (bench/gpu_check.py; docs/PERFORMANCE.md, "The floor under a hop").
//
// usage: baton-ping-pong (unix|tcp) [--bytes N] [--round-trips N]
// unix: a socketpair (AF_UNIX stream), as a node and its worker talk; tcp: a loopback TCP
// connection with TCP_NODELAY, as two hops talk. A child process echoes every message; the
// parent times round trips after a warm-up. Both block in read(), as an idle hop does, so
// each message includes waking the reader.
// Prints one JSON line: the mode, the message size, the round trips and the mean round trip
// and one-way time in microseconds.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// All n bytes, or false at EOF or an error.
bool transfer(int fd, char * data, size_t n, bool write_side) {
    while (n > 0) {
        const ssize_t done = write_side ? ::write(fd, data, n) : ::read(fd, data, n);
        if (done <= 0) {
            return false;
        }
        data += done;
        n -= static_cast<size_t>(done);
    }
    return true;
}

// A connected pair of loopback TCP sockets with TCP_NODELAY, or {-1, -1}.
std::pair<int, int> tcp_pair() {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0 ||
        ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr *>(&addr), &len) != 0) {
        return {-1, -1};
    }
    const int a = ::socket(AF_INET, SOCK_STREAM, 0);
    if (a < 0 || ::connect(a, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) {
        return {-1, -1};
    }
    const int b = ::accept(listener, nullptr, nullptr);
    ::close(listener);
    const int one = 1;
    ::setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return {a, b};
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2 || (std::strcmp(argv[1], "unix") != 0 && std::strcmp(argv[1], "tcp") != 0)) {
        std::fprintf(stderr, "usage: baton-ping-pong (unix|tcp) [--bytes N] [--round-trips N]\n");
        return 2;
    }
    const bool tcp = std::strcmp(argv[1], "tcp") == 0;
    long bytes = 2304;  // one SmolLM2 boundary row: 576 f32 values
    long round_trips = 20000;
    for (int i = 2; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        const long v = std::strtol(argv[i + 1], nullptr, 10);
        if (flag == "--bytes") bytes = v;
        else if (flag == "--round-trips") round_trips = v;
        else {
            std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
            return 2;
        }
    }
    if (bytes < 1 || round_trips < 1) {
        std::fprintf(stderr, "--bytes and --round-trips must be at least 1\n");
        return 2;
    }
    int fds[2] = {-1, -1};
    if (tcp) {
        const auto pair = tcp_pair();
        fds[0] = pair.first;
        fds[1] = pair.second;
    } else if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
        fds[0] = fds[1] = -1;
    }
    if (fds[0] < 0 || fds[1] < 0) {
        std::fprintf(stderr, "could not open a %s socket pair\n", argv[1]);
        return 1;
    }
    const long warm_up = 1000;
    std::vector<char> buffer(static_cast<size_t>(bytes));
    const pid_t child = ::fork();
    if (child < 0) {
        std::perror("fork");
        return 1;
    }
    if (child == 0) {  // the echo: every message straight back
        ::close(fds[0]);
        for (long i = 0; i < warm_up + round_trips; ++i) {
            if (!transfer(fds[1], buffer.data(), buffer.size(), false) ||
                !transfer(fds[1], buffer.data(), buffer.size(), true)) {
                return 1;
            }
        }
        return 0;
    }
    ::close(fds[1]);
    bool ok = true;
    std::chrono::steady_clock::time_point started;
    for (long i = 0; ok && i < warm_up + round_trips; ++i) {
        if (i == warm_up) {
            started = std::chrono::steady_clock::now();
        }
        ok = transfer(fds[0], buffer.data(), buffer.size(), true) &&
             transfer(fds[0], buffer.data(), buffer.size(), false);
    }
    const double elapsed_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count();
    int status = 0;
    ::waitpid(child, &status, 0);
    if (!ok || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "the echo process failed\n");
        return 1;
    }
    const double round_trip_us = elapsed_us / static_cast<double>(round_trips);
    std::printf("{\"mode\": \"%s\", \"bytes\": %ld, \"round_trips\": %ld, \"round_trip_us\": %.2f, \"one_way_us\": %.2f}\n",
                argv[1], bytes, round_trips, round_trip_us, round_trip_us / 2);
    return 0;
}
