// ForwardStreamServer: the worker's Forward stream (protocol/worker.proto, ForwardStreamReply):
// length-prefixed ForwardRequest frames on a Unix stream socket, answered in order by the same
// ShardWorkerService::Forward the gRPC call runs.
//
// Why a second socket: a unary gRPC call per step costs the node two thread hand-offs on the
// Python side (grpcio's blocking call runs on a call thread) and gRPC's per-call work on both;
// a trio task can await this socket directly (bench/results/compare.md, "Where the time
// goes"). gRPC stays the contract for everything else, and for Forward too.
//
// Owns: the listening socket (stale file removed before bind, mode 0600, removed by stop()),
// one thread accepting and one thread per connection, the greedy run-ahead of a connection (its
// thread decodes the next steps by itself until the run ends or the caller sends a frame), and
// the frame checks (a frame over max_request_bytes closes its connection after an error
// reply; an unparsable one gets an error reply). Nothing it reads can throw out of a thread or stop another connection.
#pragma once

#include "service.h"

#include <cstddef>
#include <list>
#include <mutex>
#include <string>
#include <thread>

namespace baton {

class ForwardStreamServer final {
public:
    // service must outlive the server. Does not listen until start().
    ForwardStreamServer(ShardWorkerService * service, size_t max_request_bytes);
    ~ForwardStreamServer();

    ForwardStreamServer(const ForwardStreamServer &) = delete;
    ForwardStreamServer & operator=(const ForwardStreamServer &) = delete;

    // Binds and listens on path, starts accepting. Returns "" or a one-line reason.
    std::string start(const std::string & path);
    // Stops accepting, ends every connection (a Forward in progress finishes first), joins the
    // threads and removes the socket file. Idempotent.
    void stop();

private:
    struct Connection {
        int fd = -1;
        std::thread thread;
    };

    void accept_loop();
    void serve(int fd);
    // Why the request's run-ahead fields cannot be served ("" when they can or are unset).
    std::string run_ahead_refusal(const worker::v1::ForwardRequest & request) const;
    // Sends *reply (the answer to a run-ahead request, OK) and then the run's steps, one frame
    // each, until the run ends (SequenceInput.run_ahead_steps); false when the connection is over.
    bool run_ahead(int fd, const worker::v1::SequenceInput & asked, worker::v1::ForwardStreamReply * reply);

    ShardWorkerService * service_;
    size_t max_request_bytes_;
    std::string path_;
    int listen_fd_ = -1;
    std::thread accept_thread_;
    std::mutex mu_;  // guards connections_ and stopping_
    std::list<Connection> connections_;
    bool stopping_ = false;
};

}  // namespace baton
