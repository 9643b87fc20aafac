// llama.cpp log capture (shard.h): one process-wide callback that keeps the last ERROR lines (a
// failed load's reason) and forwards everything to stderr only when BATON_LLAMA_LOG asks.
// Split from shard.cpp: process-wide state, not a shard's.
#include "shard.h"

#include "sha256.h"

#include "llama.h"
#include "llama-ext.h"  // llama_get_memory_breakdown (C++, exported)

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_set>

#ifndef BATON_LLAMA_COMMIT
#define BATON_LLAMA_COMMIT "unknown"
#endif
#ifndef BATON_PATCH_SERIES_SHA256
#define BATON_PATCH_SERIES_SHA256 "unknown"
#endif

namespace baton {
// ---------------------------------------------------------------------------------------------
// llama.cpp log capture

namespace {

struct LogCapture {
    std::mutex mu;
    std::deque<std::string> errors;  // last complete ERROR lines
    std::string partial;             // an ERROR line still being written (CONT pieces)
    bool in_error = false;
    bool passthrough = false;
};

LogCapture & log_capture() {
    static LogCapture capture;
    return capture;
}

constexpr size_t kKeptErrorLines = 4;

void trim_in_place(std::string * s) {
    const char * ws = " \t\r\n";
    const size_t b = s->find_first_not_of(ws);
    if (b == std::string::npos) {
        s->clear();
        return;
    }
    const size_t e = s->find_last_not_of(ws);
    *s = s->substr(b, e - b + 1);
}

void on_llama_log(ggml_log_level level, const char * text, void * /*user_data*/) {
    LogCapture & c = log_capture();
    if (c.passthrough) {
        std::fputs(text, stderr);
    }
    std::lock_guard<std::mutex> lock(c.mu);
    if (level != GGML_LOG_LEVEL_CONT) {
        c.in_error = level == GGML_LOG_LEVEL_ERROR;
    }
    if (!c.in_error) {
        return;
    }
    c.partial += text;
    size_t nl;
    while ((nl = c.partial.find('\n')) != std::string::npos) {
        std::string line = c.partial.substr(0, nl);
        c.partial.erase(0, nl + 1);
        trim_in_place(&line);
        if (!line.empty()) {
            c.errors.push_back(std::move(line));
            if (c.errors.size() > kKeptErrorLines) {
                c.errors.pop_front();
            }
        }
    }
}

}  // namespace

void install_llama_log_capture() {
    static std::once_flag once;
    std::call_once(once, [] {
        const char * env = std::getenv("BATON_LLAMA_LOG");
        log_capture().passthrough = env && *env && std::strcmp(env, "0") != 0;
        llama_log_set(on_llama_log, nullptr);
    });
}

std::string last_llama_errors() {
    LogCapture & c = log_capture();
    std::lock_guard<std::mutex> lock(c.mu);
    std::string out;
    for (const std::string & line : c.errors) {
        out += (out.empty() ? "" : "; ") + line;
    }
    std::string partial = c.partial;
    trim_in_place(&partial);
    if (!partial.empty()) {
        out += (out.empty() ? "" : "; ") + partial;
    }
    return out;
}

void clear_llama_errors() {
    LogCapture & c = log_capture();
    std::lock_guard<std::mutex> lock(c.mu);
    c.errors.clear();
    c.partial.clear();
    c.in_error = false;
}


}  // namespace baton
