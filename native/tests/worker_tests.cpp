// CTest driver for the shard worker, on doctest: `baton-worker-tests validation|model|service|vocab
// [doctest options]`. Each mode is a doctest TEST_SUITE of the same name; a failure names its test
// case, the expression and its values (and, for a ShardStatus, its code and message).
//
// validation: the pure helpers of shard.h / service.h, sealed.h, sha256.h, no model.
// model:      BATON_TEST_MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf (30 blocks). Loads [0,10),
//             [10,30) and [0,30) through Shard and checks that split logits are bit-identical to
//             the whole model's, across prefill, decode, several sequences, trim/copy/remove, and
//             after bad requests (which must change nothing); f16 boundary rows, the context
//             limit, top-K rows, detokenize's buffer growth.
// service:    BATON_TEST_MODEL as above; the gRPC service in-process on a Unix socket.
// vocab:      BATON_TEST_MODEL as above; a vocab-only Shard on a metadata-only sparse copy of
//             it (the GGUF's first data_offset bytes, then a hole to the full size) tokenizes
//             like the whole model, refuses Forward and the sequence calls, and refuses a copy
//             cut at data_offset (llama.cpp checks every tensor against the file size).
// A model mode (model, service, vocab) exits 77 (CTest SKIP_RETURN_CODE) when BATON_TEST_MODEL is
// unset. Options after the mode go to doctest, e.g. `baton-worker-tests model -tc='*top-K*' -s`;
// the shards a suite loads are loaded once and shared by its cases, each case starting with no
// sequences held.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "data_plane.h"
#include "engine.h"
#include "sealed.h"
#include "service.h"
#include "sha256.h"
#include "shard.h"
#include "wire_codec.h"

#include "ggml.h"
#include "gguf.h"

#include <grpcpp/grpcpp.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using baton::BoundaryDType;
using baton::ErrorCode;
using baton::ForwardEntry;
using baton::ForwardLimits;
using baton::ForwardOutput;
using baton::ShardStatus;

// A std::string, not a const char *: doctest 2.4.9's INFO and message streams print a const char *
// as a pointer.
std::string code_name(ErrorCode code) {
    switch (code) {
        case ErrorCode::kOk: return "kOk";
        case ErrorCode::kInvalidArgument: return "kInvalidArgument";
        case ErrorCode::kResourceExhausted: return "kResourceExhausted";
        case ErrorCode::kFailedPrecondition: return "kFailedPrecondition";
        case ErrorCode::kInternal: return "kInternal";
    }
    return "ErrorCode(?)";
}

std::string describe(const ShardStatus & st) {
    return code_name(st.code) + " '" + st.message + "'";
}

}  // namespace

// A message holds a text: on failure, both are shown.
#define CHECK_CONTAINS(haystack, needle)                                                          \
    do {                                                                                          \
        const std::string hay_ = (haystack);                                                      \
        const std::string needle_ = (needle);                                                     \
        CHECK_MESSAGE(hay_.find(needle_) != std::string::npos,                                    \
                      "message '" << hay_ << "' lacks '" << needle_ << "'");                      \
    } while (0)

// A ShardStatus has this code and its message holds this text; a failure shows the whole status.
#define CHECK_STATUS(st, want_code, want_text)                                                    \
    do {                                                                                          \
        const baton::ShardStatus st_ = (st);                                                      \
        INFO("status: " << describe(st_) << "; wanted " << code_name(want_code));                 \
        CHECK(st_.code == (want_code));                                                           \
        CHECK_CONTAINS(st_.message, want_text);                                                   \
    } while (0)

#define CHECK_OK(st)                                                                              \
    do {                                                                                          \
        const baton::ShardStatus st_ = (st);                                                      \
        CHECK_MESSAGE(st_.ok(), "not ok: " << describe(st_));                                     \
    } while (0)

#define REQUIRE_OK(st)                                                                            \
    do {                                                                                          \
        const baton::ShardStatus st_ = (st);                                                      \
        REQUIRE_MESSAGE(st_.ok(), "not ok: " << describe(st_));                                   \
    } while (0)

namespace {

std::string f32_bytes(const std::vector<float> & values) {
    return std::string(reinterpret_cast<const char *>(values.data()), values.size() * sizeof(float));
}

std::vector<int32_t> iota_positions(int32_t start, int32_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
        p[static_cast<size_t>(i)] = start + i;
    }
    return p;
}

ForwardLimits middle_limits() {
    ForwardLimits l;
    l.layer_begin = 10;
    l.layer_end = 20;
    l.takes_tokens = false;
    l.gives_logits = false;
    l.n_embd = 4;
    l.n_vocab = 100;
    l.n_seq_max = 4;
    l.n_batch_max = 8;
    l.n_ctx_per_sequence = 16;
    return l;
}

ForwardEntry boundary_entry(uint32_t seq, int32_t start, int32_t n_rows, const std::string & bytes) {
    ForwardEntry e;
    e.seq_id = seq;
    e.positions = iota_positions(start, n_rows);
    e.boundary = bytes;
    e.boundary_dtype = BoundaryDType::kF32;
    return e;
}

// 5000 values in [-40, 56] with many repeats (a fixed LCG), and its ids sorted by (value desc, id asc).
const std::vector<float> & big_row() {
    static const std::vector<float> big = [] {
        std::vector<float> v(5000);
        uint32_t state = 12345;
        for (float & x : v) {
            state = state * 1664525u + 1013904223u;
            x = static_cast<float>((state >> 8) % 97) - 40.0f;
        }
        return v;
    }();
    return big;
}

const std::vector<int32_t> & big_row_order() {
    static const std::vector<int32_t> order = [] {
        const std::vector<float> & big = big_row();
        std::vector<int32_t> o(big.size());
        for (size_t i = 0; i < o.size(); ++i) {
            o[i] = static_cast<int32_t>(i);
        }
        std::sort(o.begin(), o.end(), [&](int32_t a, int32_t b) { return big[a] > big[b] || (big[a] == big[b] && a < b); });
        return o;
    }();
    return order;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_SUITE("validation") {

TEST_CASE("check_schema_version accepts 1 only") {
    CHECK_OK(baton::check_schema_version(1));
    CHECK_STATUS(baton::check_schema_version(0), ErrorCode::kInvalidArgument,
                 "schema_version 0 is not supported (this worker speaks 1)");
    CHECK_STATUS(baton::check_schema_version(2), ErrorCode::kInvalidArgument, "schema_version 2");
}

TEST_CASE("check_positions: a sequence's positions start at its next position and rise by 1") {
    CHECK_OK(baton::check_positions(3, {0, 1, 2}, 0));
    CHECK_OK(baton::check_positions(3, {7}, 7));
    CHECK_STATUS(baton::check_positions(3, {1, 2}, 0), ErrorCode::kInvalidArgument,
                 "positions for seq 3 must start at 0 and increase by 1; got 1, 2");
    CHECK_STATUS(baton::check_positions(4, {5, 6, 8}, 5), ErrorCode::kInvalidArgument, "row 2");
    CHECK_STATUS(baton::check_positions(4, {5, 5}, 5), ErrorCode::kInvalidArgument, "must start at 5");
    CHECK_STATUS(baton::check_positions(0, {std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()},
                                        std::numeric_limits<int32_t>::max()),
                 ErrorCode::kInvalidArgument, "row 1");
}

TEST_CASE("check_boundary_bytes and boundary_dtype_size") {
    CHECK_OK(baton::check_boundary_bytes(0, 1, 2 * 576 * 4, 2, 576, 4));
    CHECK_STATUS(baton::check_boundary_bytes(0, 1, 2 * 576 * 4 - 1, 2, 576, 4), ErrorCode::kInvalidArgument,
                 "row width: got 4607 bytes, expected 2 rows x 576 values x 4 bytes = 4608");
    CHECK_STATUS(baton::check_boundary_bytes(2, 9, 3 * 576 * 4, 2, 576, 4), ErrorCode::kInvalidArgument,
                 "entry 2 (seq 9): 2 positions but 3 boundary rows");
    CHECK_STATUS(baton::check_boundary_bytes(0, 1, 0, 1, 576, 2), ErrorCode::kInvalidArgument, "1 positions but 0");

    CHECK(baton::boundary_dtype_size(BoundaryDType::kF32) == 4);
    CHECK(baton::boundary_dtype_size(BoundaryDType::kF16) == 2);
    CHECK(baton::boundary_dtype_size(BoundaryDType::kUnspecified) == 0);
    CHECK(baton::boundary_dtype_size(static_cast<BoundaryDType>(7)) == 0);
}

// The rows and the bytes of tests/test_core_boundary.py's Q8 example: both encoders give them.
static std::vector<float> q8_example_rows() {
    std::vector<float> rows(80, 0.0f);
    for (int i = 0; i < 40; ++i) {
        rows[static_cast<size_t>(i)] = static_cast<float>(i - 17) * 0.37f;
    }
    rows[35] = 100.0f;
    rows[3] = 0.0f;
    const float second[] = {127.0f, 2.5f, 3.5f, -2.5f, 0.5f, 1.5f};
    std::copy(std::begin(second), std::end(second), rows.begin() + 40);
    rows[50] = 254.0f;
    return rows;
}

static std::string from_hex(const std::string & hex) {
    std::string out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    return out;
}

TEST_CASE("Q8 rows encode to the bytes the Python codec gives, and decode to q * d") {
    const std::vector<float> rows = q8_example_rows();
    std::string bytes;
    REQUIRE(baton::encode_boundary_rows(rows.data(), 2, 40, BoundaryDType::kQ8, &bytes));
    const std::string expected = from_hex(
        "81ee3e3df943833dae47c9c00000c84200030081890099a1a9b1b9c0c8d0d8e0e8f0f8000810182028303840474f575f676f575c62006e73797f"
        "0000803f0000000000007e43000000000a007f0204fe000200000000000000000000000000000000000000000000000000000000000000000000");
    CHECK(bytes == expected);
    CHECK(baton::q8_row_bytes(40) == 58);
    CHECK(baton::boundary_wire_bytes(BoundaryDType::kQ8, 2, 40) == 116);
    CHECK(baton::boundary_wire_bytes(BoundaryDType::kF16S, 2, 40) == 2 * (4 + 80));
    CHECK(baton::boundary_wire_bytes(BoundaryDType::kF16, 2, 40) == 160);
    CHECK(baton::boundary_wire_bytes(static_cast<BoundaryDType>(7), 2, 40) == 0);
    std::vector<float> back(80);
    REQUIRE(baton::decode_boundary_rows(bytes.data(), 2, 40, BoundaryDType::kQ8, back.data()));
    CHECK(back[40] == 127.0f);
    CHECK(back[41] == 2.0f);  // 2.5: half to even
    CHECK(back[42] == 4.0f);
    CHECK(back[43] == -2.0f);
    CHECK(back[50] == 254.0f);  // the outliers: as sent
    CHECK(back[0] == rows[0]);
    CHECK(back[35] == 100.0f);
    for (size_t i = 0; i < 40; ++i) {
        CHECK(std::fabs(back[i] - rows[i]) <= 8.14f / 127.0f / 2.0f * 1.0001f);  // 8.14: block 1's largest after 100
    }
    CHECK(baton::find_non_finite_q8(bytes.data(), 2, 40) == -1);
    std::string bad = bytes;
    const float huge = 3e38f;  // 128 of it overflow
    std::memcpy(bad.data() + 58 + 4, &huge, sizeof(float));
    CHECK(baton::find_non_finite_q8(bad.data(), 2, 40) == 40 + 32);
    bad = bytes;
    bad[17] = 8;  // row 0's second block holds 8 values
    CHECK(baton::find_non_finite_q8(bad.data(), 2, 40) == 32);
    // F16S: a row past f16's range is scaled by a power of two, as the Python codec does
    const float wide[4] = {1.5f, -90685.0f, 0.25f, 3.0f};
    REQUIRE(baton::encode_boundary_rows(wide, 1, 4, BoundaryDType::kF16S, &bytes));
    REQUIRE(bytes.size() == 12);
    float scale = 0.0f;
    std::memcpy(&scale, bytes.data(), sizeof(float));
    CHECK(scale == 4.0f);
    CHECK(baton::find_non_finite_f16s(bytes.data(), 1, 4) == -1);
    float wide_back[4];
    REQUIRE(baton::decode_boundary_rows(bytes.data(), 1, 4, BoundaryDType::kF16S, wide_back));
    CHECK(wide_back[0] == 1.5f);
    CHECK(wide_back[1] == -90688.0f);  // f16's 11 bits at 2^16 (x 4): steps of 16
    // f16 out of range is refused, not sent as Inf
    const float big[2] = {1.0f, 1e6f};
    CHECK_FALSE(baton::encode_boundary_rows(big, 1, 2, BoundaryDType::kF16, &bytes));
}

TEST_CASE("find_non_finite_f32 and find_non_finite_f16 name the first non-finite value") {
    std::vector<float> v(10000, 1.5f);
    CHECK(baton::find_non_finite_f32(v.data(), v.size()) == -1);
    v[9999] = std::numeric_limits<float>::infinity();
    CHECK(baton::find_non_finite_f32(v.data(), v.size()) == 9999);
    v[5000] = -std::numeric_limits<float>::infinity();
    CHECK(baton::find_non_finite_f32(v.data(), v.size()) == 5000);
    v[4097] = std::nanf("");
    CHECK(baton::find_non_finite_f32(v.data(), v.size()) == 4097);
    v[0] = -std::numeric_limits<float>::quiet_NaN();
    CHECK(baton::find_non_finite_f32(v.data(), v.size()) == 0);
    CHECK(baton::find_non_finite_f32(v.data(), 0) == -1);
    std::vector<float> edge = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::denorm_min(), -0.0f};
    CHECK(baton::find_non_finite_f32(edge.data(), edge.size()) == -1);
    // Unaligned input (protobuf bytes carry no alignment promise).
    std::string raw(1 + 8 * sizeof(float), '\0');
    std::vector<float> w(8, 2.0f);
    w[6] = std::numeric_limits<float>::infinity();
    std::memcpy(&raw[1], w.data(), 8 * sizeof(float));
    CHECK(baton::find_non_finite_f32(raw.data() + 1, 8) == 6);

    const std::vector<uint16_t> halves = {0x3c00, 0xbc00, 0x7bff, 0x0001, 0x7c00, 0x7e00};
    CHECK(baton::find_non_finite_f16(halves.data(), 4) == -1);
    CHECK(baton::find_non_finite_f16(halves.data(), 5) == 4);
    CHECK(baton::find_non_finite_f16(halves.data() + 5, 1) == 0);
}

TEST_CASE("find_duplicate_seq_id, check_batch_rows and check_context_room") {
    CHECK(baton::find_duplicate_seq_id({}) == -1);
    CHECK(baton::find_duplicate_seq_id({0, 1, 2}) == -1);
    CHECK(baton::find_duplicate_seq_id({0, 1, 0}) == 2);
    CHECK(baton::find_duplicate_seq_id({3, 3}) == 1);

    CHECK_OK(baton::check_batch_rows(512, 512));
    CHECK_STATUS(baton::check_batch_rows(513, 512), ErrorCode::kResourceExhausted,
                 "batch of 513 rows exceeds the limit of 512");
    CHECK_OK(baton::check_context_room(1, 100, 28, 128));
    CHECK_STATUS(baton::check_context_room(1, 100, 29, 128), ErrorCode::kResourceExhausted, "context full for seq 1");
}

TEST_CASE("validate_forward: a middle range takes and gives boundary rows") {
    const std::vector<int32_t> next = {0, 3, 0, 15};
    const std::string one_row = f32_bytes({1, 2, 3, 4});
    const std::string two_rows = f32_bytes({1, 2, 3, 4, 5, 6, 7, 8});
    const ForwardLimits mid = middle_limits();

    CHECK_OK(baton::validate_forward(mid, {boundary_entry(0, 0, 2, two_rows), boundary_entry(1, 3, 1, one_row)}, next));
    CHECK_STATUS(baton::validate_forward(mid, {}, next), ErrorCode::kInvalidArgument, "empty request");
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 1, one_row), boundary_entry(0, 1, 1, one_row)}, next),
                 ErrorCode::kInvalidArgument, "entry 1 (seq 0): seq_id 0 appears more than once");
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(4, 0, 1, one_row)}, next), ErrorCode::kInvalidArgument,
                 "seq_id 4 is out of range");
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 0, "")}, next), ErrorCode::kInvalidArgument,
                 "entry 0 (seq 0): no rows");
    {
        const std::string no_bytes;
        ForwardEntry e = boundary_entry(0, 0, 1, no_bytes);
        e.token_ids = {5};
        CHECK_STATUS(baton::validate_forward(mid, {e}, next), ErrorCode::kInvalidArgument,
                     "range [10,20) takes boundary rows, not token ids");
    }
    {
        ForwardEntry e = boundary_entry(0, 0, 1, one_row);
        e.boundary_dtype = BoundaryDType::kUnspecified;
        CHECK_STATUS(baton::validate_forward(mid, {e}, next), ErrorCode::kInvalidArgument, "boundary_dtype 0");
        e.boundary_dtype = BoundaryDType::kF16;  // 16 bytes of f16 = 2 rows of 4, but 1 position
        CHECK_STATUS(baton::validate_forward(mid, {e}, next), ErrorCode::kInvalidArgument, "1 positions but 2 boundary rows");
        const std::vector<uint16_t> h = {0x3c00, 0x3c00, 0x3c00, 0x3c00};
        const std::string hb(reinterpret_cast<const char *>(h.data()), 8);
        e.boundary = hb;
        CHECK_OK(baton::validate_forward(mid, {e}, next));
        const std::vector<uint16_t> hn = {0x3c00, 0x7c00, 0x3c00, 0x3c00};
        const std::string hnb(reinterpret_cast<const char *>(hn.data()), 8);
        e.boundary = hnb;
        CHECK_STATUS(baton::validate_forward(mid, {e}, next), ErrorCode::kInvalidArgument, "row 0, column 1 is not finite");
    }
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 1, one_row + "xyz")}, next),
                 ErrorCode::kInvalidArgument, "row width: got 19 bytes");
    {
        const std::string nan_rows = f32_bytes({1, 2, 3, 4, 5, std::nanf(""), 7, 8});
        CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 2, nan_rows)}, next),
                     ErrorCode::kInvalidArgument, "entry 0 (seq 0): boundary value at row 1, column 1 is not finite");
    }
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(1, 2, 1, one_row)}, next), ErrorCode::kInvalidArgument,
                 "positions for seq 1 must start at 3 and increase by 1; got 2");
    CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(3, 15, 2, two_rows)}, next),
                 ErrorCode::kResourceExhausted, "context full for seq 3");
    {
        std::vector<float> many(9 * 4, 0.5f);
        CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 9, f32_bytes(many))}, next),
                     ErrorCode::kResourceExhausted, "batch of 9 rows exceeds the limit of 8");
        // Split over two entries, still too many in total.
        std::vector<float> five(5 * 4, 0.5f);
        std::vector<float> four(4 * 4, 0.5f);
        CHECK_STATUS(baton::validate_forward(mid, {boundary_entry(0, 0, 5, f32_bytes(five)),
                                                   boundary_entry(2, 0, 4, f32_bytes(four))},
                                             next),
                     ErrorCode::kResourceExhausted, "batch of 9 rows");
    }
    {
        // logit_rows are ignored by a range that gives boundary rows.
        ForwardEntry e = boundary_entry(0, 0, 1, one_row);
        e.logit_rows = {7};
        CHECK_OK(baton::validate_forward(mid, {e}, next));
    }
}

TEST_CASE("validate_forward: the first range takes token ids") {
    const std::vector<int32_t> next = {0, 3, 0, 15};
    const std::string two_rows = f32_bytes({1, 2, 3, 4, 5, 6, 7, 8});
    ForwardLimits first = middle_limits();
    first.layer_begin = 0;
    first.takes_tokens = true;

    ForwardEntry e;
    e.seq_id = 0;
    e.positions = {0, 1};
    e.token_ids = {1, 99};
    CHECK_OK(baton::validate_forward(first, {e}, next));
    e.token_ids = {1, 100};
    CHECK_STATUS(baton::validate_forward(first, {e}, next), ErrorCode::kInvalidArgument,
                 "token id 100 at row 1 is outside [0, 100)");
    e.token_ids = {-1, 2};
    CHECK_STATUS(baton::validate_forward(first, {e}, next), ErrorCode::kInvalidArgument, "token id -1 at row 0");
    e.token_ids = {1};
    CHECK_STATUS(baton::validate_forward(first, {e}, next), ErrorCode::kInvalidArgument, "2 positions but 1 token ids");
    e.token_ids = {1, 2};
    e.boundary = two_rows;
    CHECK_STATUS(baton::validate_forward(first, {e}, next), ErrorCode::kInvalidArgument,
                 "range [0,20) takes token ids, not boundary rows");
}

TEST_CASE("validate_forward: the last range checks logit_rows") {
    const std::vector<int32_t> next = {0, 3, 0, 15};
    const std::string two_rows = f32_bytes({1, 2, 3, 4, 5, 6, 7, 8});
    ForwardLimits last = middle_limits();
    last.layer_end = 30;
    last.gives_logits = true;

    ForwardEntry e = boundary_entry(0, 0, 2, two_rows);
    e.logit_rows = {0, 1};
    CHECK_OK(baton::validate_forward(last, {e}, next));
    e.logit_rows = {2};
    CHECK_STATUS(baton::validate_forward(last, {e}, next), ErrorCode::kInvalidArgument,
                 "logit_rows names row 2 but the entry has 2 rows");
    e.logit_rows = {1, 1};
    CHECK_STATUS(baton::validate_forward(last, {e}, next), ErrorCode::kInvalidArgument, "names row 1 twice");
}

TEST_CASE("parse_layer_range") {
    int32_t b = -5;
    int32_t e = -5;
    std::string err;
    CHECK(baton::parse_layer_range("0:10", &b, &e, &err));
    CHECK(b == 0);
    CHECK(e == 10);
    CHECK(baton::parse_layer_range("10:", &b, &e, &err));
    CHECK(b == 10);
    CHECK(e == -1);
    CHECK(baton::parse_layer_range("10:-1", &b, &e, &err));
    CHECK(b == 10);
    CHECK(e == -1);
    for (const std::string bad : {"", "10", ":10", "a:b", "10:5", "10:10", "-1:5", "1:-2", "1:2x", "99999999999:"}) {
        CAPTURE(bad);
        err.clear();
        CHECK_FALSE(baton::parse_layer_range(bad, &b, &e, &err));
        CHECK_FALSE(err.empty());
    }
}

TEST_CASE("sha256_hex, is_sha256_hex and compute_recipe_hash") {
    CHECK(baton::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(baton::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(baton::is_sha256_hex(std::string(64, 'a')));
    CHECK_FALSE(baton::is_sha256_hex(std::string(63, 'a')));
    CHECK_FALSE(baton::is_sha256_hex(std::string(64, 'g')));
    CHECK(baton::compute_recipe_hash("m", "c", "p", "CPU") == baton::sha256_hex("m\nc\np\nCPU\nresidual/1\nf32"));
}

TEST_CASE("gRPC message size limits and to_grpc_status") {
    baton::ShardInfo info;
    info.n_embd = 576;
    info.n_vocab = 49152;
    info.n_batch_max = 512;
    info.gives_logits = false;
    CHECK(baton::max_receive_message_bytes(info) >= 512 * 576 * 4);
    CHECK(baton::max_send_message_bytes(info) >= 512 * 576 * 4);
    info.gives_logits = true;
    CHECK(baton::max_send_message_bytes(info) >= 512 * 49152 * 4);
    info.n_batch_max = 100000;
    CHECK(baton::max_send_message_bytes(info) == std::numeric_limits<int>::max());

    CHECK(baton::to_grpc_status(ShardStatus::Ok()).ok());
    CHECK(baton::to_grpc_status(ShardStatus::Invalid("x")).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(baton::to_grpc_status(ShardStatus::Exhausted("x")).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(baton::to_grpc_status(ShardStatus::Internal("why")).error_message() == "why");
}

TEST_CASE("select_top_k: value descending, id ascending; NaN refused") {
    // Ties (3.0 at 1, 4, 6; -0.0 == 0.0), -inf, k > n: the order is value descending, id ascending.
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> row = {1.0f, 3.0f, -inf, 2.0f, 3.0f, 0.0f, 3.0f, -0.0f, 5.0f};
    std::vector<int32_t> ids(row.size(), -1);
    std::vector<float> values(row.size(), 0.0f);
    CHECK(baton::select_top_k(row.data(), row.size(), 3, ids.data(), values.data()));
    CHECK(ids[0] == 8);
    CHECK(ids[1] == 1);
    CHECK(ids[2] == 4);
    CHECK(values[0] == 5.0f);
    CHECK(values[2] == 3.0f);
    CHECK(ids[3] == -1);  // nothing written past k
    CHECK(baton::select_top_k(row.data(), row.size(), 100, ids.data(), values.data()));
    const std::vector<int32_t> all = {8, 1, 4, 6, 3, 0, 5, 7, 2};
    CHECK(ids == all);
    CHECK(std::signbit(values[7]));  // the row's own bits
    CHECK(values[8] == -inf);
    CHECK(baton::select_top_k(row.data(), 1, 1, ids.data(), values.data()));
    CHECK(ids[0] == 0);

    // Against a full sort by (value desc, id asc) on a row with many repeats.
    const std::vector<float> & big = big_row();
    const std::vector<int32_t> & order = big_row_order();
    for (size_t k : {1u, 7u, 40u, 1000u}) {
        CAPTURE(k);
        std::vector<int32_t> got(k);
        std::vector<float> got_values(k);
        CHECK(baton::select_top_k(big.data(), big.size(), k, got.data(), got_values.data()));
        CHECK(std::equal(got.begin(), got.end(), order.begin()));
    }

    std::vector<float> with_nan = {1.0f, std::nanf(""), 2.0f};
    CHECK_FALSE(baton::select_top_k(with_nan.data(), with_nan.size(), 1, ids.data(), values.data()));
    // A NaN far into a row, in a block whose other values could not enter the top-k: still refused.
    std::vector<float> late_nan(big);
    late_nan[4321] = std::nanf("");
    CHECK_FALSE(baton::select_top_k(late_nan.data(), late_nan.size(), 7, ids.data(), values.data()));
    // A rising row (every block holds a new best) and a row whose best comes last.
    std::vector<float> rising(3000);
    for (size_t i = 0; i < rising.size(); ++i) {
        rising[i] = static_cast<float>(i) * 0.5f;
    }
    CHECK(baton::select_top_k(rising.data(), rising.size(), 3, ids.data(), values.data()));
    CHECK(ids[0] == 2999);
    CHECK(ids[1] == 2998);
    CHECK(ids[2] == 2997);
    std::vector<float> best_last(big);
    best_last.back() = 1000.0f;
    CHECK(baton::select_top_k(best_last.data(), best_last.size(), 2, ids.data(), values.data()));
    CHECK(ids[0] == static_cast<int32_t>(best_last.size() - 1));
    CHECK(ids[1] == order[0]);
}

TEST_CASE("top_k_log_sum_exp: select_top_k's ids and values, log_sum_exp's bits") {
    const std::vector<float> & big = big_row();
    for (size_t k : {1u, 40u, 1000u}) {
        CAPTURE(k);
        std::vector<int32_t> a(k), b(k);
        std::vector<float> av(k), bv(k);
        double lse = 0.0;
        CHECK(baton::top_k_log_sum_exp(big.data(), big.size(), k, a.data(), av.data(), &lse));
        CHECK(baton::select_top_k(big.data(), big.size(), k, b.data(), bv.data()));
        CHECK(a == b);
        CHECK(av == bv);
        CHECK(lse == baton::log_sum_exp(big.data(), big.size()));
    }
    std::vector<float> late_nan(big);
    late_nan[4321] = std::nanf("");
    std::vector<int32_t> ids(7);
    std::vector<float> values(7);
    double unused = 0.0;
    CHECK_FALSE(baton::top_k_log_sum_exp(late_nan.data(), late_nan.size(), 7, ids.data(), values.data(), &unused));
}

TEST_CASE("log_sum_exp: max-shifted, -inf adds nothing, a non-finite max as is") {
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> lse_row = {1000.0f, 1000.0f, -inf};
    CHECK(std::fabs(baton::log_sum_exp(lse_row.data(), lse_row.size()) - (1000.0 + std::log(2.0))) < 1e-12);
    const std::vector<float> minus_inf = {-inf, -inf};
    CHECK(baton::log_sum_exp(minus_inf.data(), minus_inf.size()) == -inf);
    const std::vector<float> & big = big_row();
    double sum = 0.0;
    for (float v : big) {
        sum += std::exp(static_cast<double>(v) - 56.0);
    }
    CHECK(std::fabs(baton::log_sum_exp(big.data(), big.size()) - (56.0 + std::log(sum))) < 1e-9);
}

TEST_CASE("exp_shifted: within 1 ulp of libm over [-708, 0], 1 at 0, 0 below -708 and at -inf, NaN as NaN") {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> xs;
    for (int i = 0; i <= 200000; ++i) {
        xs.push_back(static_cast<float>(-708.0 * i / 200000.0));
    }
    for (double shift : {0.0, 0.37, -3.5, 11.25}) {
        CAPTURE(shift);
        std::vector<double> got(xs.size());
        baton::exp_shifted(xs.data(), xs.size(), shift, got.data());
        int64_t worst_ulp = 0;
        for (size_t i = 0; i < xs.size(); ++i) {
            const double v = static_cast<double>(xs[i]) - shift;
            if (v > 0.0 || v < -708.0) {
                continue;
            }
            const double want = std::exp(v);
            int64_t a = 0;
            int64_t b = 0;
            std::memcpy(&a, &got[i], sizeof a);
            std::memcpy(&b, &want, sizeof b);
            worst_ulp = std::max<int64_t>(worst_ulp, a > b ? a - b : b - a);
        }
        CHECK(worst_ulp <= 1);
    }
    const std::vector<float> edges = {0.0f, -0.0f, -708.5f, -745.0f, -1e30f, -inf, std::nanf("")};
    std::vector<double> edge_out(edges.size());
    baton::exp_shifted(edges.data(), edges.size(), 0.0, edge_out.data());
    CHECK(edge_out[0] == 1.0);
    CHECK(edge_out[1] == 1.0);
    CHECK(edge_out[2] == 0.0);
    CHECK(edge_out[3] == 0.0);
    CHECK(edge_out[4] == 0.0);
    CHECK(edge_out[5] == 0.0);
    CHECK(std::isnan(edge_out[6]));
}

TEST_CASE("sealed data frames open only with the same key, kind, session and counter") {
    using namespace baton;
    const std::string key(32, '\x07');
    const std::string sid(16, '\x01');
    std::string sealed;
    std::string plain;
    REQUIRE(seal_data_frame(key, 1, sid, 5, "boundary rows", &sealed));
    CHECK(sealed.size() == std::string("boundary rows").size() + kDataTagBytes);
    CHECK(open_data_frame(key, 1, sid, 5, sealed, &plain));
    CHECK(plain == "boundary rows");
    // anything that differs: no plaintext
    CHECK_FALSE(open_data_frame(std::string(32, '\x08'), 1, sid, 5, sealed, &plain));  // another key
    CHECK_FALSE(open_data_frame(key, 2, sid, 5, sealed, &plain));                       // another kind
    CHECK_FALSE(open_data_frame(key, 1, std::string(16, '\x02'), 5, sealed, &plain));  // another session
    CHECK_FALSE(open_data_frame(key, 1, sid, 6, sealed, &plain));                       // another counter
    std::string changed = sealed;
    changed[0] ^= 1;
    CHECK_FALSE(open_data_frame(key, 1, sid, 5, changed, &plain));
    CHECK_FALSE(open_data_frame(key, 1, sid, 5, sealed.substr(0, 8), &plain));          // shorter than a tag
    CHECK_FALSE(seal_data_frame("short", 1, sid, 5, "x", &sealed));
    // an empty body seals to a tag alone, and opens to nothing
    REQUIRE(seal_data_frame(key, 3, sid, 1, "", &sealed));
    CHECK(sealed.size() == kDataTagBytes);
    CHECK(open_data_frame(key, 3, sid, 1, sealed, &plain));
    CHECK(plain.empty());
    CHECK(data_frame_aad(1, sid, 2).size() == std::string("baton-data/1").size() + 4 + 16 + 8);
}

TEST_CASE("parse_host_port") {
    std::string host;
    uint16_t port = 0;
    std::string error;
    CHECK(baton::parse_host_port("127.0.0.1:0", &host, &port, &error));
    CHECK(host == "127.0.0.1");
    CHECK(port == 0);
    CHECK(baton::parse_host_port("[::1]:7001", &host, &port, &error));
    CHECK(host == "::1");
    CHECK(port == 7001);
    CHECK_FALSE(baton::parse_host_port("127.0.0.1", &host, &port, &error));
    CHECK_CONTAINS(error, "HOST:PORT");
    CHECK_FALSE(baton::parse_host_port("h:65536", &host, &port, &error));
    CHECK_CONTAINS(error, "0 to 65535");
    CHECK_FALSE(baton::parse_host_port("h:-1", &host, &port, &error));
    CHECK_FALSE(baton::parse_host_port("h:12x", &host, &port, &error));
}

TEST_CASE("order_graph_candidates: select_top_k's order of unordered candidates; lse from the best") {
    // candidates as ggml_top_k may give them: any order, a tie (ids 9 and 4 at 2.0)
    const std::vector<int32_t> ids = {9, 17, 4, 30};
    const std::vector<float> logits = {2.0f, 3.5f, 2.0f, -1.0f};
    const std::vector<float> probs = {0.1f, 0.25f, 0.1f, 0.01f};
    std::vector<int32_t> out_ids(3);
    std::vector<float> out_values(3);
    double lse = 0.0;
    REQUIRE(baton::order_graph_candidates(ids.data(), logits.data(), probs.data(), 4, 3, out_ids.data(),
                                          out_values.data(), &lse));
    CHECK(out_ids == std::vector<int32_t>{17, 4, 9});
    CHECK(out_values == std::vector<float>{3.5f, 2.0f, 2.0f});
    CHECK(lse == 3.5 - std::log(static_cast<double>(0.25f)));
    // k above n takes the n candidates
    std::vector<int32_t> all_ids(4);
    std::vector<float> all_values(4);
    REQUIRE(baton::order_graph_candidates(ids.data(), logits.data(), probs.data(), 4, 9, all_ids.data(),
                                          all_values.data(), &lse));
    CHECK(all_ids == std::vector<int32_t>{17, 4, 9, 30});
    // a NaN logit, or a NaN probability of the best (a NaN elsewhere in the row), is refused
    std::vector<float> nan_logits = logits;
    nan_logits[3] = std::nanf("");
    CHECK_FALSE(baton::order_graph_candidates(ids.data(), nan_logits.data(), probs.data(), 4, 2, out_ids.data(),
                                              out_values.data(), &lse));
    std::vector<float> nan_probs = probs;
    nan_probs[1] = std::nanf("");
    CHECK_FALSE(baton::order_graph_candidates(ids.data(), logits.data(), nan_probs.data(), 4, 2, out_ids.data(),
                                              out_values.data(), &lse));
    // a non-finite best logit is the log-sum-exp, as log_sum_exp returns it
    const std::vector<float> inf_logits = {-INFINITY, -INFINITY};
    const std::vector<float> nan_both = {std::nanf(""), std::nanf("")};
    REQUIRE(baton::order_graph_candidates(ids.data(), inf_logits.data(), nan_both.data(), 2, 1, out_ids.data(),
                                          out_values.data(), &lse));
    CHECK(lse == -INFINITY);
}

TEST_CASE("graph_top_k_for: the largest K clamped to n_vocab, 0 when an entry wants full rows") {
    std::vector<ForwardEntry> es(3);
    es[0].top_k = 5;
    es[1].top_k = 40;
    es[2].top_k = 1;
    CHECK(baton::graph_top_k_for(es, 1000) == 40);
    CHECK(baton::graph_top_k_for(es, 32) == 32);
    es[1].top_k = 0;
    CHECK(baton::graph_top_k_for(es, 1000) == 0);
    baton::TopKInGraph mode = baton::TopKInGraph::kOff;
    CHECK(baton::parse_top_k_in_graph("on", &mode));
    CHECK(mode == baton::TopKInGraph::kOn);
    CHECK_FALSE(baton::parse_top_k_in_graph("yes", &mode));
    CHECK(baton::top_k_in_graph_enabled(baton::TopKInGraph::kAuto, "CUDA", -1));
    CHECK_FALSE(baton::top_k_in_graph_enabled(baton::TopKInGraph::kAuto, "CUDA", 0));
    CHECK_FALSE(baton::top_k_in_graph_enabled(baton::TopKInGraph::kAuto, "CPU", -1));
    CHECK(baton::top_k_in_graph_enabled(baton::TopKInGraph::kOn, "CPU", 0));
    CHECK_FALSE(baton::top_k_in_graph_enabled(baton::TopKInGraph::kOff, "CUDA", -1));
}

}  // TEST_SUITE("validation")

// ---------------------------------------------------------------------------------------------
// Model tests: shards loaded once per suite and shared by its cases.

namespace {

const char * test_model() {
    const char * path = std::getenv("BATON_TEST_MODEL");
    // main() exits 77 (skipped) before running a model suite without it; this is for -ts= by hand.
    REQUIRE_MESSAGE((path != nullptr && *path != '\0'), "BATON_TEST_MODEL is not set");
    return path;
}

// BATON_TEST_GPU_LAYERS=-1 runs the model tests on a GPU build's accelerator (bench/gpu_check.py);
// unset, they run on the CPU, as CI's build does.
int32_t test_gpu_layers() {
    const char * text = std::getenv("BATON_TEST_GPU_LAYERS");
    return text != nullptr ? static_cast<int32_t>(std::strtol(text, nullptr, 10)) : 0;
}

baton::ShardConfig test_config(const char * model, int32_t begin, int32_t end) {
    baton::ShardConfig c;
    c.model_path = model;
    c.layer_begin = begin;
    c.layer_end = end;
    c.ctx_size_per_seq = 256;
    c.max_sequences = 4;
    c.batch_size = 64;
    c.threads = 2;
    c.gpu_layers = test_gpu_layers();
    c.model_sha256 = std::string(64, '0');  // hashing is tested elsewhere; keep the test fast
    // the host path, whose log-sum-exp is log_sum_exp's bit for bit, also with
    // BATON_TEST_GPU_LAYERS=-1 (where kAuto would select in the graph); the in-graph path is
    // graph_top_k_shard()'s
    c.top_k_in_graph = baton::TopKInGraph::kOff;
    return c;
}

std::unique_ptr<baton::Shard> load(const char * model, int32_t begin, int32_t end) {
    try {
        return std::make_unique<baton::Shard>(test_config(model, begin, end));
    } catch (const std::exception & e) {
        FAIL("cannot load [" << begin << "," << end << ") of " << std::string(model) << ": " << std::string(e.what()));
    }
    return nullptr;
}

// Removes every sequence a shard holds, so that a case starts from an empty KV cache.
void release_sequences(baton::Shard * s) {
    for (uint32_t seq = 0; seq < s->info().n_seq_max; ++seq) {
        int32_t next = -1;
        if (s->next_position(seq) > 0) {
            CHECK_OK(s->remove_sequence(seq, &next));
        }
    }
    REQUIRE(s->active_sequences() == 0);
}

// [0,30), [0,10) and [10,30) of BATON_TEST_MODEL, loaded by the first case that asks.
struct ModelShards {
    std::unique_ptr<baton::Shard> whole;
    std::unique_ptr<baton::Shard> head;
    std::unique_ptr<baton::Shard> tail;
};

ModelShards & model_shards() {
    static ModelShards shards;
    if (!shards.whole || !shards.head || !shards.tail) {
        const char * model = test_model();
        ModelShards loaded;
        loaded.whole = load(model, 0, -1);
        loaded.head = load(model, 0, 10);
        loaded.tail = load(model, 10, -1);
        shards = std::move(loaded);
    }
    for (baton::Shard * s : {shards.whole.get(), shards.head.get(), shards.tail.get()}) {
        release_sequences(s);
    }
    return shards;
}

ForwardEntry token_entry(uint32_t seq, int32_t start, const std::vector<int32_t> & tokens,
                         std::vector<uint32_t> logit_rows = {}) {
    ForwardEntry e;
    e.seq_id = seq;
    e.positions = iota_positions(start, static_cast<int32_t>(tokens.size()));
    e.token_ids = tokens;
    e.logit_rows = std::move(logit_rows);
    return e;
}

std::vector<int32_t> tokenize(baton::Shard * s, const std::string & text) {
    std::vector<int32_t> tokens;
    REQUIRE_OK(s->tokenize(text, true, false, &tokens));
    return tokens;
}

// The two-hop pipeline [0,10) -> [10,30) next to the whole model [0,30).
struct Pipeline {
    baton::Shard * head;
    baton::Shard * tail;
    baton::Shard * whole;

    // Runs token entries through both paths; returns false after recording a failure.
    // split/whole: the last range's outputs (logits) in request order.
    bool run(const std::vector<ForwardEntry> & entries, std::vector<ForwardOutput> * split,
             std::vector<ForwardOutput> * full) {
        std::vector<ForwardOutput> mid;
        ShardStatus st = head->forward(entries, &mid);
        if (!st.ok()) {
            FAIL_CHECK("head forward: " << describe(st));
            return false;
        }
        std::vector<ForwardEntry> tail_entries;
        for (size_t i = 0; i < entries.size(); ++i) {
            CAPTURE(i);
            ForwardEntry e;
            e.seq_id = entries[i].seq_id;
            e.positions = entries[i].positions;
            e.boundary = mid[i].boundary;
            e.boundary_dtype = BoundaryDType::kF32;
            e.logit_rows = entries[i].logit_rows;
            tail_entries.push_back(std::move(e));
            CHECK(mid[i].n_rows == entries[i].positions.size());
            CHECK(mid[i].boundary.size() == entries[i].positions.size() * head->info().n_embd * sizeof(float));
            CHECK(mid[i].logits.empty());
        }
        st = tail->forward(tail_entries, split);
        if (!st.ok()) {
            FAIL_CHECK("tail forward: " << describe(st));
            return false;
        }
        st = whole->forward(entries, full);
        if (!st.ok()) {
            FAIL_CHECK("whole forward: " << describe(st));
            return false;
        }
        return true;
    }

    bool run_and_compare(const std::vector<ForwardEntry> & entries, std::vector<ForwardOutput> * out = nullptr) {
        std::vector<ForwardOutput> split;
        std::vector<ForwardOutput> full;
        if (!run(entries, &split, &full)) {
            return false;
        }
        bool same = split.size() == full.size();
        size_t i = 0;
        for (; same && i < split.size(); ++i) {
            same = split[i].seq_id == full[i].seq_id && split[i].logit_rows == full[i].logit_rows &&
                   split[i].next_position == full[i].next_position && split[i].logits.size() == full[i].logits.size() &&
                   !split[i].logits.empty() &&
                   std::memcmp(split[i].logits.data(), full[i].logits.data(), full[i].logits.size()) == 0;
        }
        if (!same) {
            FAIL_CHECK("split logits differ from the whole model's (" << split.size() << " and " << full.size()
                                                                       << " outputs; first difference at output "
                                                                       << (i == 0 ? 0 : i - 1) << ")");
        }
        if (out != nullptr) {
            *out = std::move(full);
        }
        return same;
    }
};

int32_t argmax_last_row(const ForwardOutput & o, uint32_t n_vocab) {
    const float * row = reinterpret_cast<const float *>(o.logits.data()) + (o.n_rows - 1) * static_cast<size_t>(n_vocab);
    int32_t best = 0;
    for (uint32_t t = 1; t < n_vocab; ++t) {
        if (row[t] > row[best]) {
            best = static_cast<int32_t>(t);
        }
    }
    return best;
}

}  // namespace

TEST_SUITE("model") {

TEST_CASE("the ranges [0,30), [0,10) and [10,30) describe their layers, sizes and backend") {
    ModelShards & m = model_shards();
    const baton::ShardInfo & wi = m.whole->info();
    const baton::ShardInfo & hi = m.head->info();
    const baton::ShardInfo & ti = m.tail->info();

    CHECK(wi.layer_begin == 0);
    CHECK(wi.layer_end == wi.n_layer);
    CHECK(wi.takes_tokens);
    CHECK(wi.gives_logits);
    CHECK(hi.layer_begin == 0);
    CHECK(hi.layer_end == 10);
    CHECK(hi.takes_tokens);
    CHECK_FALSE(hi.gives_logits);
    CHECK(ti.layer_begin == 10);
    CHECK(ti.layer_end == wi.n_layer);
    CHECK_FALSE(ti.takes_tokens);
    CHECK(ti.gives_logits);
    CHECK(hi.n_embd == wi.n_embd);
    CHECK(ti.n_embd == wi.n_embd);
    CHECK(ti.n_vocab == wi.n_vocab);
    CHECK(hi.weight_bytes < wi.weight_bytes);
    CHECK(ti.weight_bytes < wi.weight_bytes);
    CHECK(hi.kv_bytes > 0);
    CHECK(ti.kv_bytes > 0);
    CHECK(hi.kv_bytes < ti.kv_bytes);
    CHECK(ti.kv_bytes < wi.kv_bytes);
    // offloaded (a GPU build under BATON_TEST_GPU_LAYERS), the blocks are on the accelerator
    CHECK(wi.weight_buffer_bytes > 0);
    if (test_gpu_layers() != 0) {
        CHECK(wi.backend != "CPU");
    } else {
        CHECK(wi.backend == "CPU");
    }
    CHECK(wi.architecture == "llama");
    CHECK(wi.recipe_hash == hi.recipe_hash);
    CHECK(wi.n_seq_max == 4);
    CHECK(wi.n_batch_max == 64);
    CHECK(wi.n_ctx_per_sequence == 256);
    std::fprintf(stderr, "model: %s n_layer %u n_embd %u n_vocab %u; weights whole %llu head %llu tail %llu; "
                         "kv whole %llu head %llu tail %llu\n",
                 wi.architecture.c_str(), wi.n_layer, wi.n_embd, wi.n_vocab,
                 (unsigned long long) wi.weight_bytes, (unsigned long long) hi.weight_bytes,
                 (unsigned long long) ti.weight_bytes, (unsigned long long) wi.kv_bytes,
                 (unsigned long long) hi.kv_bytes, (unsigned long long) ti.kv_bytes);
}

TEST_CASE("every range tokenizes and detokenizes alike (the vocab is always loaded)") {
    ModelShards & m = model_shards();
    std::vector<int32_t> prompt;
    std::vector<int32_t> prompt_tail;
    CHECK_OK(m.whole->tokenize("The capital of France is", true, false, &prompt));
    CHECK_OK(m.tail->tokenize("The capital of France is", true, false, &prompt_tail));
    CHECK(prompt == prompt_tail);
    CHECK(prompt.size() >= 4);
    std::string text;
    CHECK_OK(m.head->detokenize(prompt, true, false, &text));
    CHECK(text == "The capital of France is");
}

TEST_CASE("split logits equal the whole model's: prefill, bad requests, decode beside a prefill, trim, copy, remove") {
    ModelShards & m = model_shards();
    baton::Shard * whole = m.whole.get();
    baton::Shard * head = m.head.get();
    baton::Shard * tail = m.tail.get();
    const baton::ShardInfo & wi = whole->info();
    const std::vector<int32_t> prompt = tokenize(whole, "The capital of France is");
    Pipeline p{head, tail, whole};
    const int32_t n_prompt = static_cast<int32_t>(prompt.size());

    // Prefill seq 0 with logits for every row.
    std::vector<uint32_t> all_rows;
    for (int32_t r = 0; r < n_prompt; ++r) {
        all_rows.push_back(static_cast<uint32_t>(r));
    }
    std::vector<ForwardOutput> out;
    {
        INFO("step: prefill seq 0");
        REQUIRE(p.run_and_compare({token_entry(0, 0, prompt, all_rows)}, &out));
        CHECK(out[0].n_rows == static_cast<uint32_t>(n_prompt));
        CHECK(out[0].next_position == n_prompt);
    }
    int32_t next_token = argmax_last_row(out[0], wi.n_vocab);

    {
        INFO("step: a bad request to each shard changes nothing");
        std::vector<ForwardOutput> junk;
        std::vector<float> rows(wi.n_embd, 0.25f);
        rows[3] = std::nanf("");
        const std::string nan_row = f32_bytes(rows);
        ForwardEntry bad = boundary_entry(0, n_prompt, 1, nan_row);
        CHECK_STATUS(tail->forward({bad}, &junk), ErrorCode::kInvalidArgument, "is not finite");
        CHECK_STATUS(tail->forward({boundary_entry(0, 0, 1, f32_bytes(std::vector<float>(wi.n_embd, 1.f)))}, &junk),
                     ErrorCode::kInvalidArgument, "must start at " + std::to_string(n_prompt));
        CHECK_STATUS(head->forward({token_entry(0, n_prompt, {next_token}), token_entry(0, n_prompt, {next_token})}, &junk),
                     ErrorCode::kInvalidArgument, "appears more than once");
        CHECK_STATUS(head->forward({token_entry(0, n_prompt, {next_token}), token_entry(1, 0, {-3})}, &junk),
                     ErrorCode::kInvalidArgument, "entry 1 (seq 1): token id -3");
        CHECK_STATUS(whole->forward({token_entry(0, n_prompt, {next_token}), token_entry(1, 0, std::vector<int32_t>(64, 1))},
                                    &junk),
                     ErrorCode::kResourceExhausted, "batch of 65 rows exceeds the limit of 64");
        CHECK_STATUS(whole->forward({token_entry(0, n_prompt, {next_token}, {1})}, &junk), ErrorCode::kInvalidArgument,
                     "logit_rows names row 1");
        CHECK(head->next_position(0) == n_prompt);
        CHECK(tail->next_position(0) == n_prompt);
        CHECK(whole->next_position(0) == n_prompt);
        CHECK(head->next_position(1) == 0);
        CHECK(whole->active_sequences() == 1);
    }

    int32_t pos0 = n_prompt;
    int32_t pos1 = 0;
    int32_t next1 = 0;
    {
        INFO("step: greedy decode of seq 0 while seq 1 prefills in the same batch");
        const std::vector<int32_t> prompt1 = tokenize(whole, "Once upon a time, in a small village,");
        REQUIRE(p.run_and_compare({token_entry(1, 0, prompt1), token_entry(0, pos0, {next_token})}, &out));
        REQUIRE(out.size() == 2);
        CHECK(out[0].seq_id == 1);
        CHECK(out[1].seq_id == 0);
        CHECK(out[0].n_rows == 1);
        CHECK(out[0].logit_rows == std::vector<uint32_t>{static_cast<uint32_t>(prompt1.size() - 1)});
        next1 = argmax_last_row(out[0], wi.n_vocab);
        next_token = argmax_last_row(out[1], wi.n_vocab);
        ++pos0;
        pos1 = static_cast<int32_t>(prompt1.size());
        for (int step = 0; step < 4; ++step) {
            CAPTURE(step);
            REQUIRE(p.run_and_compare({token_entry(0, pos0, {next_token}), token_entry(1, pos1, {next1})}, &out));
            next_token = argmax_last_row(out[0], wi.n_vocab);
            next1 = argmax_last_row(out[1], wi.n_vocab);
            ++pos0;
            ++pos1;
        }
        CHECK(whole->active_sequences() == 2);
        CHECK(head->active_sequences() == 2);
    }

    int32_t next_pos = -1;
    {
        INFO("step: trim seq 1 back by two positions on every hop and continue: still identical");
        for (baton::Shard * s : {head, tail, whole}) {
            INFO("range [" << s->info().layer_begin << "," << s->info().layer_end << ")");
            CHECK_OK(s->trim_sequence(1, pos1 - 2, &next_pos));
            CHECK(next_pos == pos1 - 2);
            CHECK_STATUS(s->trim_sequence(1, pos1, &next_pos), ErrorCode::kInvalidArgument, "keep_positions");
            CHECK_STATUS(s->trim_sequence(1, -1, &next_pos), ErrorCode::kInvalidArgument, "keep_positions");
            CHECK_STATUS(s->trim_sequence(2, 0, &next_pos), ErrorCode::kInvalidArgument, "unknown sequence 2");
        }
        pos1 -= 2;
        REQUIRE(p.run_and_compare({token_entry(1, pos1, {next1, next1})}, &out));
        pos1 += 2;
    }

    {
        INFO("step: copy seq 0 to seq 2 on every hop; the same token on both gives the same logits");
        for (baton::Shard * s : {head, tail, whole}) {
            INFO("range [" << s->info().layer_begin << "," << s->info().layer_end << ")");
            CHECK_STATUS(s->copy_sequence(0, 1, &next_pos), ErrorCode::kInvalidArgument, "already holds");
            CHECK_STATUS(s->copy_sequence(3, 2, &next_pos), ErrorCode::kInvalidArgument, "unknown sequence 3");
            CHECK_STATUS(s->copy_sequence(0, 9, &next_pos), ErrorCode::kInvalidArgument, "out of range");
            CHECK_OK(s->copy_sequence(0, 2, &next_pos));
            CHECK(next_pos == pos0);
        }
        std::vector<ForwardOutput> on_copy;
        std::vector<ForwardOutput> on_orig;
        REQUIRE(p.run_and_compare({token_entry(2, pos0, {next_token})}, &on_copy));
        REQUIRE(p.run_and_compare({token_entry(0, pos0, {next_token})}, &on_orig));
        CHECK(on_copy[0].logits == on_orig[0].logits);
    }

    {
        INFO("step: remove seq 2: it is unknown again and starts over at 0");
        for (baton::Shard * s : {head, tail, whole}) {
            INFO("range [" << s->info().layer_begin << "," << s->info().layer_end << ")");
            CHECK_OK(s->remove_sequence(2, &next_pos));
            CHECK(next_pos == 0);
            CHECK_STATUS(s->remove_sequence(2, &next_pos), ErrorCode::kInvalidArgument, "unknown sequence 2");
            CHECK_STATUS(s->remove_sequence(7, &next_pos), ErrorCode::kInvalidArgument, "out of range");
        }
        std::vector<ForwardOutput> junk;
        CHECK_STATUS(whole->forward({token_entry(2, pos0 + 1, {next_token})}, &junk), ErrorCode::kInvalidArgument,
                     "positions for seq 2 must start at 0");
        REQUIRE(p.run_and_compare({token_entry(2, 0, prompt)}, &out));
    }
}

TEST_CASE("boundary rows sent as f16 are accepted and widened (finite, same argmax as the whole model)") {
    ModelShards & m = model_shards();
    const baton::ShardInfo & wi = m.whole->info();
    const std::vector<int32_t> prompt = tokenize(m.whole.get(), "The capital of France is");
    const int32_t n_prompt = static_cast<int32_t>(prompt.size());
    std::vector<uint32_t> all_rows;
    for (int32_t r = 0; r < n_prompt; ++r) {
        all_rows.push_back(static_cast<uint32_t>(r));
    }
    // The whole model's prefill of the prompt (with logits for every row, as the split test's first step).
    std::vector<ForwardOutput> on_whole;
    REQUIRE_OK(m.whole->forward({token_entry(0, 0, prompt, all_rows)}, &on_whole));

    std::vector<ForwardOutput> mid;
    std::vector<ForwardOutput> last;
    REQUIRE_OK(m.head->forward({token_entry(3, 0, prompt)}, &mid));
    const float * rows = reinterpret_cast<const float *>(mid[0].boundary.data());
    const size_t n_values = mid[0].boundary.size() / sizeof(float);
    std::vector<ggml_fp16_t> halves(n_values);
    for (size_t i = 0; i < n_values; ++i) {
        halves[i] = ggml_fp32_to_fp16(rows[i]);
    }
    const std::string f16_bytes(reinterpret_cast<const char *>(halves.data()), n_values * sizeof(ggml_fp16_t));
    ForwardEntry e;
    e.seq_id = 3;
    e.positions = iota_positions(0, n_prompt);
    e.boundary = f16_bytes;
    e.boundary_dtype = BoundaryDType::kF16;
    REQUIRE_OK(m.tail->forward({e}, &last));
    CHECK(last[0].next_position == n_prompt);
    CHECK(last[0].logits.size() == wi.n_vocab * sizeof(float));
    CHECK(baton::find_non_finite_f32(last[0].logits.data(), wi.n_vocab) == -1);
    CHECK(argmax_last_row(last[0], wi.n_vocab) == argmax_last_row(on_whole[0], wi.n_vocab));
    int32_t next_pos = -1;
    CHECK_OK(m.head->remove_sequence(3, &next_pos));
    CHECK_OK(m.tail->remove_sequence(3, &next_pos));
}

TEST_CASE("boundary rows sent as Q8 are accepted and decoded (finite, same argmax as the whole model)") {
    ModelShards & m = model_shards();
    const baton::ShardInfo & wi = m.whole->info();
    const std::vector<int32_t> prompt = tokenize(m.whole.get(), "The capital of France is");
    const int32_t n_prompt = static_cast<int32_t>(prompt.size());
    std::vector<ForwardOutput> on_whole;
    REQUIRE_OK(m.whole->forward({token_entry(0, 0, prompt)}, &on_whole));
    std::vector<ForwardOutput> mid;
    std::vector<ForwardOutput> last;
    REQUIRE_OK(m.head->forward({token_entry(3, 0, prompt)}, &mid));
    std::string q8;
    REQUIRE(baton::encode_boundary_rows(reinterpret_cast<const float *>(mid[0].boundary.data()),
                                        static_cast<size_t>(n_prompt), wi.n_embd, BoundaryDType::kQ8, &q8));
    ForwardEntry e;
    e.seq_id = 3;
    e.positions = iota_positions(0, n_prompt);
    e.boundary = q8;
    e.boundary_dtype = BoundaryDType::kQ8;
    ForwardEntry short_entry = e;
    const std::string cut = q8.substr(0, q8.size() - 1);
    short_entry.boundary = cut;
    CHECK_STATUS(m.tail->forward({short_entry}, &last), ErrorCode::kInvalidArgument, "Q8 rows of");
    REQUIRE_OK(m.tail->forward({e}, &last));
    CHECK(last[0].next_position == n_prompt);
    CHECK(baton::find_non_finite_f32(last[0].logits.data(), wi.n_vocab) == -1);
    CHECK(argmax_last_row(last[0], wi.n_vocab) == argmax_last_row(on_whole[0], wi.n_vocab));
    int32_t next_pos = -1;
    CHECK_OK(m.head->remove_sequence(3, &next_pos));
    CHECK_OK(m.tail->remove_sequence(3, &next_pos));
}

TEST_CASE("a sequence holds 256 positions, then its context is full") {
    ModelShards & m = model_shards();
    baton::Shard * whole = m.whole.get();
    const std::vector<int32_t> prompt = tokenize(whole, "The capital of France is");
    std::vector<ForwardOutput> junk;
    CHECK(whole->next_position(3) == 0);
    for (int32_t start = 0; start < 256; start += 64) {
        CAPTURE(start);
        CHECK_OK(whole->forward({token_entry(3, start, std::vector<int32_t>(64, prompt[1]))}, &junk));
    }
    CHECK_STATUS(whole->forward({token_entry(3, 256, {prompt[1]})}, &junk), ErrorCode::kResourceExhausted,
                 "context full for seq 3");
    int32_t next_pos = -1;
    CHECK_OK(whole->remove_sequence(3, &next_pos));
}

// Two sequences and several logit rows each in one Forward (computed in parallel over the Shard's
// threads) give, row by row, select_top_k and log_sum_exp of the full rows the same Forward
// returns without top_k.
TEST_CASE("top-K rows equal select_top_k and log_sum_exp of the full rows") {
    ModelShards & m = model_shards();
    baton::Shard * whole = m.whole.get();
    const baton::ShardInfo & wi = whole->info();
    const std::vector<int32_t> prompt = tokenize(whole, "The capital of France is");
    const int32_t n_prompt = static_cast<int32_t>(prompt.size());
    auto entries = [&](uint32_t top_k) {
        std::vector<ForwardEntry> es = {token_entry(3, 0, prompt, {0, 2, static_cast<uint32_t>(n_prompt - 1)}),
                                        token_entry(2, 0, {prompt[1], prompt[0]}, {0, 1})};
        for (ForwardEntry & e : es) {
            e.top_k = top_k;
        }
        return es;
    };
    int32_t next_pos = -1;
    std::vector<ForwardOutput> full;
    std::vector<ForwardOutput> top;
    REQUIRE_OK(whole->forward(entries(0), &full));
    CHECK_OK(whole->remove_sequence(2, &next_pos));
    CHECK_OK(whole->remove_sequence(3, &next_pos));
    REQUIRE_OK(whole->forward(entries(40), &top));
    REQUIRE(full.size() == 2);
    REQUIRE(top.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
        CAPTURE(i);
        CHECK(top[i].top_k == 40);
        CHECK(top[i].logits.empty());
        CHECK(top[i].log_sum_exp.size() == full[i].n_rows);
        for (size_t j = 0; j < full[i].n_rows; ++j) {
            CAPTURE(j);
            const float * row = reinterpret_cast<const float *>(full[i].logits.data()) + j * wi.n_vocab;
            std::vector<int32_t> ids(40);
            std::vector<float> values(40);
            CHECK(baton::select_top_k(row, wi.n_vocab, 40, ids.data(), values.data()));
            CHECK(std::memcmp(ids.data(), top[i].top_token_ids.data() + j * 40 * sizeof(int32_t), 40 * 4) == 0);
            CHECK(std::memcmp(values.data(), top[i].top_logits.data() + j * 40 * sizeof(float), 40 * 4) == 0);
            CHECK(top[i].log_sum_exp[j] == baton::log_sum_exp(row, wi.n_vocab));
        }
    }
    CHECK_OK(whole->remove_sequence(2, &next_pos));
    CHECK_OK(whole->remove_sequence(3, &next_pos));
}

namespace {

// A range of the model selecting top-K in its graph (--top-k-in-graph on): the whole model
// (tail false) or [10,30), loaded by the first case that asks; its sequences released like
// model_shards()'.
baton::Shard * graph_top_k_shard(bool tail = false) {
    static std::unique_ptr<baton::Shard> shards[2];
    std::unique_ptr<baton::Shard> & shard = shards[tail ? 1 : 0];
    if (!shard) {
        baton::ShardConfig c = test_config(test_model(), tail ? 10 : 0, -1);
        c.top_k_in_graph = baton::TopKInGraph::kOn;
        try {
            shard = std::make_unique<baton::Shard>(c);
        } catch (const std::exception & e) {
            FAIL("cannot load the in-graph top-K shard: " << std::string(e.what()));
        }
    }
    release_sequences(shard.get());
    return shard.get();
}

struct TopKTally {
    size_t rows = 0;
    size_t boundary_ties = 0;  // rows whose k-th value is shared with an id past the k-th
    double max_lse_diff = 0.0;
};

// One Forward of entries on the host path, the same again with full rows (the sequences trimmed
// back in between: the same logits, bit for bit), and on the in-graph shard; then, row by row,
// the same ids (but where the k-th value is tied past k: topk_select.h), the same values, and
// log-sum-exps within kGraphLogSumExpTolerance. Returns the host's outputs (the graph's into
// *graph_out when given).
std::vector<ForwardOutput> compare_graph_top_k(baton::Shard * host, baton::Shard * graph,
                                               const std::vector<ForwardEntry> & entries, TopKTally * tally,
                                               std::vector<ForwardOutput> * graph_out = nullptr) {
    std::vector<ForwardOutput> by_host;
    std::vector<ForwardOutput> full;
    std::vector<ForwardOutput> by_graph;
    REQUIRE_OK(host->forward(entries, &by_host));
    std::vector<ForwardEntry> full_entries = entries;
    for (ForwardEntry & e : full_entries) {
        int32_t next = -1;
        REQUIRE_OK(host->trim_sequence(e.seq_id, e.positions.front(), &next));
        e.top_k = 0;
    }
    REQUIRE_OK(host->forward(full_entries, &full));
    REQUIRE_OK(graph->forward(entries, &by_graph));
    const uint32_t n_vocab = host->info().n_vocab;
    REQUIRE(by_graph.size() == by_host.size());
    for (size_t i = 0; i < by_host.size(); ++i) {
        CAPTURE(i);
        const ForwardOutput & h = by_host[i];
        const ForwardOutput & g = by_graph[i];
        REQUIRE(g.top_k == h.top_k);
        REQUIRE(g.logit_rows == h.logit_rows);
        REQUIRE(g.top_token_ids.size() == h.top_token_ids.size());
        CHECK(g.logits.empty());
        CHECK(g.next_position == h.next_position);
        // the values never depend on which tied id was kept
        CHECK(std::memcmp(g.top_logits.data(), h.top_logits.data(), h.top_logits.size()) == 0);
        const size_t k = h.top_k;
        for (size_t j = 0; j < h.logit_rows.size(); ++j) {
            CAPTURE(j);
            ++tally->rows;
            const auto * hid = reinterpret_cast<const int32_t *>(h.top_token_ids.data()) + j * k;
            const auto * gid = reinterpret_cast<const int32_t *>(g.top_token_ids.data()) + j * k;
            const auto * val = reinterpret_cast<const float *>(h.top_logits.data()) + j * k;
            const float * row = reinterpret_cast<const float *>(full[i].logits.data()) + j * n_vocab;
            const size_t k1 = std::min<size_t>(k + 1, n_vocab);
            std::vector<int32_t> ids1(k1);
            std::vector<float> values1(k1);
            REQUIRE(baton::select_top_k(row, n_vocab, k1, ids1.data(), values1.data()));
            const bool tie_past_k = k1 > k && values1[k] == val[k - 1];
            tally->boundary_ties += tie_past_k ? 1 : 0;
            for (size_t t = 0; t < k; ++t) {
                CAPTURE(t);
                CHECK((gid[t] == hid[t] || (tie_past_k && val[t] == val[k - 1])));
            }
            const double diff = std::fabs(g.log_sum_exp[j] - h.log_sum_exp[j]);
            CHECK(diff <= baton::kGraphLogSumExpTolerance);
            CHECK(h.log_sum_exp[j] == baton::log_sum_exp(row, n_vocab));
            tally->max_lse_diff = std::max(tally->max_lse_diff, diff);
        }
    }
    if (graph_out != nullptr) {
        *graph_out = std::move(by_graph);
    }
    return by_host;
}

}  // namespace

// The in-graph selection (patch 0010, llama_set_logits_top_k) run on the CPU backend against
// the host path (select_top_k, log_sum_exp): a prefill of three sequences, several logit rows
// and a different K each (one graph K, the largest, read as each entry's prefix), then batched
// decode steps at K = 1, 40 and 1000; then a batch where one entry asks for full rows, which
// takes the host path for all. The prefill also through [0,10) -> [10,30) selecting in the graph:
// the split's logits are the whole model's, bit for bit, so its selection is too.
TEST_CASE("in-graph top-K equals the host path's: ids and values exact, log-sum-exp within the bound") {
    ModelShards & m = model_shards();
    baton::Shard * host = m.whole.get();
    baton::Shard * graph = graph_top_k_shard();
    TopKTally tally;
    const std::vector<std::vector<int32_t>> prompts = {tokenize(host, "The capital of France is"),
                                                       tokenize(host, "def fibonacci(n):\n    return"),
                                                       tokenize(host, "Once upon a time, in a small village,")};
    std::vector<ForwardEntry> prefill;
    const std::vector<uint32_t> ks = {40, 5, 1};
    for (uint32_t s = 0; s < 3; ++s) {
        const uint32_t last = static_cast<uint32_t>(prompts[s].size() - 1);
        prefill.push_back(token_entry(s, 0, prompts[s], s == 1 ? std::vector<uint32_t>{last}
                                                                : std::vector<uint32_t>{0, last / 2, last}));
        prefill.back().top_k = ks[s];
    }
    std::vector<ForwardOutput> whole_graph;
    std::vector<ForwardOutput> out = compare_graph_top_k(host, graph, prefill, &tally, &whole_graph);
    {
        baton::Shard * head = m.head.get();
        baton::Shard * tail = graph_top_k_shard(true);
        std::vector<ForwardOutput> mid;
        std::vector<ForwardOutput> split;
        REQUIRE_OK(head->forward(prefill, &mid));
        std::vector<ForwardEntry> tail_entries;
        for (size_t s = 0; s < prefill.size(); ++s) {
            ForwardEntry e = prefill[s];
            e.token_ids.clear();
            e.boundary = mid[s].boundary;
            e.boundary_dtype = BoundaryDType::kF32;
            tail_entries.push_back(std::move(e));
        }
        REQUIRE_OK(tail->forward(tail_entries, &split));
        REQUIRE(split.size() == whole_graph.size());
        for (size_t s = 0; s < split.size(); ++s) {
            CAPTURE(s);
            CHECK(split[s].top_token_ids == whole_graph[s].top_token_ids);
            CHECK(split[s].top_logits == whole_graph[s].top_logits);
            CHECK(split[s].log_sum_exp == whole_graph[s].log_sum_exp);
        }
        release_sequences(head);
        release_sequences(tail);
    }
    std::vector<int32_t> next_token(3);
    std::vector<int32_t> next_pos(3);
    for (size_t s = 0; s < 3; ++s) {
        next_token[s] = reinterpret_cast<const int32_t *>(out[s].top_token_ids.data())[(out[s].logit_rows.size() - 1) * out[s].top_k];
        next_pos[s] = out[s].next_position;
    }
    for (uint32_t k : {1u, 40u, 1000u, 40u}) {
        CAPTURE(k);
        std::vector<ForwardEntry> step;
        for (uint32_t s = 0; s < 3; ++s) {
            step.push_back(token_entry(s, next_pos[s], {next_token[s]}));
            step.back().top_k = k;
        }
        out = compare_graph_top_k(host, graph, step, &tally);
        for (size_t s = 0; s < 3; ++s) {
            next_token[s] = reinterpret_cast<const int32_t *>(out[s].top_token_ids.data())[0];
            next_pos[s] = out[s].next_position;
        }
    }
    // one entry with full rows: no selection in the graph, every entry from the full rows
    std::vector<ForwardEntry> mixed;
    for (uint32_t s = 0; s < 3; ++s) {
        mixed.push_back(token_entry(s, next_pos[s], {next_token[s]}));
        mixed.back().top_k = s == 1 ? 0 : 40;
    }
    std::vector<ForwardOutput> by_host;
    std::vector<ForwardOutput> by_graph;
    REQUIRE_OK(host->forward(mixed, &by_host));
    REQUIRE_OK(graph->forward(mixed, &by_graph));
    for (size_t s = 0; s < 3; ++s) {
        CAPTURE(s);
        CHECK(by_graph[s].logits == by_host[s].logits);
        CHECK(by_graph[s].top_token_ids == by_host[s].top_token_ids);
        CHECK(by_graph[s].top_logits == by_host[s].top_logits);
        CHECK(by_graph[s].log_sum_exp == by_host[s].log_sum_exp);
    }
    CHECK(by_host[1].logits.size() == host->info().n_vocab * sizeof(float));
    MESSAGE("in-graph top-K on " << host->info().backend << ": " << tally.rows << " rows, "
                                 << tally.boundary_ties << " with the k-th value tied past k, max |lse difference| "
                                 << tally.max_lse_diff);
    release_sequences(host);
    release_sequences(graph);
}

// Detokenize a text longer than the first guess of its size (the "buffer too small" path).
TEST_CASE("detokenize a text longer than the first guess of its size; tokenize a long text") {
    ModelShards & m = model_shards();
    baton::Shard * whole = m.whole.get();
    const baton::ShardInfo & wi = whole->info();
    int32_t longest = 0;
    std::string longest_text;
    for (int32_t t = 0; t < static_cast<int32_t>(wi.n_vocab); ++t) {
        std::string piece;
        if (whole->detokenize({t}, false, true, &piece).ok() && piece.size() > longest_text.size()) {
            longest = t;
            longest_text = piece;
        }
    }
    CAPTURE(longest);
    std::string many;
    CHECK_OK(whole->detokenize(std::vector<int32_t>(10, longest), false, true, &many));
    CHECK(many.size() >= 10 * longest_text.size() - 10);
    CHECK_STATUS(whole->detokenize({static_cast<int32_t>(wi.n_vocab)}, false, false, &many),
                 ErrorCode::kInvalidArgument, "outside");
    std::vector<int32_t> toks;
    const std::string long_text(5000, 'a');
    CHECK_OK(whole->tokenize(long_text, true, false, &toks));
    CHECK_FALSE(toks.empty());
}

}  // TEST_SUITE("model")

// ---------------------------------------------------------------------------------------------
// Service tests: the gRPC service in-process on a Unix socket, over [0,30) loaded once.

namespace v1 = baton::worker::v1;

namespace {

baton::Shard * service_shard() {
    static std::unique_ptr<baton::Shard> shard;
    if (!shard) {
        shard = load(test_model(), 0, -1);
    }
    release_sequences(shard.get());
    return shard.get();
}

// A fresh service (its own counters) and server per case.
struct ServiceFixture {
    baton::Shard * shard = service_shard();
    baton::ShardWorkerService service{shard};
    const std::string socket_path = "/tmp/baton-worker-test-" + std::to_string(::getpid()) + ".sock";
    std::unique_ptr<grpc::Server> server;
    std::unique_ptr<v1::ShardWorker::Stub> stub;

    ServiceFixture() {
        ::unlink(socket_path.c_str());
        grpc::ServerBuilder builder;
        builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
        builder.SetMaxReceiveMessageSize(baton::max_receive_message_bytes(shard->info()));
        builder.SetMaxSendMessageSize(baton::max_send_message_bytes(shard->info()));
        builder.RegisterService(&service);
        server = builder.BuildAndStart();
        REQUIRE(server != nullptr);
        stub = v1::ShardWorker::NewStub(grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
    }

    ~ServiceFixture() {
        if (server) {
            server->Shutdown();
        }
        ::unlink(socket_path.c_str());
    }

    ServiceFixture(const ServiceFixture &) = delete;
    ServiceFixture & operator=(const ServiceFixture &) = delete;

    std::vector<int32_t> tokenize_rpc(const std::string & text) {
        grpc::ClientContext ctx;
        v1::TokenizeRequest req;
        req.set_schema_version(1);
        req.set_text(text);
        req.set_add_special(true);
        v1::TokenizeReply rep;
        const grpc::Status st = stub->Tokenize(&ctx, req, &rep);
        REQUIRE_MESSAGE(st.ok(), "Tokenize: " << st.error_message());
        return std::vector<int32_t>(rep.token_ids().begin(), rep.token_ids().end());
    }

    grpc::Status forward(int32_t start, const std::vector<int32_t> & toks, v1::ForwardReply * rep) {
        grpc::ClientContext ctx;
        v1::ForwardRequest req;
        req.set_schema_version(1);
        v1::SequenceInput * in = req.add_entries();
        in->set_seq_id(0);
        for (size_t i = 0; i < toks.size(); ++i) {
            in->add_positions(start + static_cast<int32_t>(i));
            in->add_token_ids(toks[i]);
        }
        return stub->Forward(&ctx, req, rep);
    }
};

}  // namespace

TEST_SUITE("service") {

TEST_CASE_FIXTURE(ServiceFixture, "Info refuses schema_version 0, then describes the whole model") {
    {
        grpc::ClientContext ctx;
        v1::InfoRequest req;
        v1::InfoReply rep;
        grpc::Status st = stub->Info(&ctx, req, &rep);
        CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
        CHECK_CONTAINS(st.error_message(), "schema_version 0 is not supported (this worker speaks 1)");
    }
    grpc::ClientContext ctx;
    v1::InfoRequest req;
    req.set_schema_version(1);
    v1::InfoReply rep;
    const grpc::Status st = stub->Info(&ctx, req, &rep);
    REQUIRE_MESSAGE(st.ok(), "Info: " << st.error_message());
    CHECK(rep.schema_version() == 1);
    CHECK(rep.architecture() == "llama");
    CHECK(rep.n_layer() == 30);
    CHECK(rep.boundary().name() == "residual");
    CHECK(rep.boundary().version() == 1);
    CHECK(rep.boundary().dtype() == v1::DTYPE_F32);
    CHECK(rep.boundary().n_embd() == rep.n_embd());
    CHECK(rep.takes_tokens());
    CHECK(rep.gives_logits());
    CHECK(rep.recipe_hash().size() == 64);
    CHECK(rep.n_batch_max() == 64);
    CHECK(rep.n_seq_max() == 4);
    CHECK(rep.kv_bytes() > 0);
}

TEST_CASE_FIXTURE(ServiceFixture, "Tokenize then Detokenize gives the text back") {
    const std::vector<int32_t> tokens = tokenize_rpc("Hello world");
    CHECK_FALSE(tokens.empty());
    grpc::ClientContext ctx;
    v1::DetokenizeRequest req;
    req.set_schema_version(1);
    req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
    req.set_remove_special(true);
    v1::DetokenizeReply rep;
    const grpc::Status st = stub->Detokenize(&ctx, req, &rep);
    REQUIRE_MESSAGE(st.ok(), "Detokenize: " << st.error_message());
    CHECK(rep.text() == "Hello world");
}

TEST_CASE_FIXTURE(ServiceFixture, "Forward, Health and the sequence RPCs; errors leave it serving") {
    const std::vector<int32_t> tokens = tokenize_rpc("Hello world");
    REQUIRE_FALSE(tokens.empty());
    {
        v1::ForwardReply rep;
        const grpc::Status st = forward(0, tokens, &rep);
        REQUIRE_MESSAGE(st.ok(), "Forward: " << st.error_message());
        REQUIRE(rep.entries_size() == 1);
        CHECK(rep.dtype() == v1::DTYPE_F32);
        CHECK(rep.entries(0).logits().size() == shard->info().n_vocab * sizeof(float));
        CHECK(rep.entries(0).next_position() == static_cast<int32_t>(tokens.size()));
        CHECK(rep.entries(0).logit_rows_size() == 1);
    }
    {
        v1::ForwardReply rep;
        grpc::Status st = forward(0, tokens, &rep);  // positions do not continue
        CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
        CHECK_CONTAINS(st.error_message(), "must start at " + std::to_string(tokens.size()));
        st = forward(static_cast<int32_t>(tokens.size()), std::vector<int32_t>(65, 1), &rep);
        CHECK(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
    {
        grpc::ClientContext ctx;
        v1::HealthRequest req;
        req.set_schema_version(1);
        v1::HealthReply rep;
        REQUIRE(stub->Health(&ctx, req, &rep).ok());
        CHECK(rep.ready());
        CHECK(rep.forward_calls() == 1);
        CHECK(rep.active_sequences() == 1);
    }
    {
        grpc::ClientContext ctx;
        v1::TrimSequenceRequest req;
        req.set_schema_version(1);
        req.set_seq_id(0);
        req.set_keep_positions(1);
        v1::SequenceReply rep;
        REQUIRE(stub->TrimSequence(&ctx, req, &rep).ok());
        CHECK(rep.seq_id() == 0);
        CHECK(rep.next_position() == 1);
    }
    {
        grpc::ClientContext ctx;
        v1::CopySequenceRequest req;
        req.set_schema_version(1);
        req.set_src_seq_id(0);
        req.set_dst_seq_id(3);
        v1::SequenceReply rep;
        REQUIRE(stub->CopySequence(&ctx, req, &rep).ok());
        CHECK(rep.seq_id() == 3);
        CHECK(rep.next_position() == 1);
    }
    for (uint32_t seq : {0u, 3u}) {
        CAPTURE(seq);
        grpc::ClientContext ctx;
        v1::RemoveSequenceRequest req;
        req.set_schema_version(1);
        req.set_seq_id(seq);
        v1::SequenceReply rep;
        REQUIRE(stub->RemoveSequence(&ctx, req, &rep).ok());
        CHECK(rep.next_position() == 0);
    }
    {
        grpc::ClientContext ctx;
        v1::RemoveSequenceRequest req;
        req.set_schema_version(1);
        req.set_seq_id(0);
        v1::SequenceReply rep;
        grpc::Status st = stub->RemoveSequence(&ctx, req, &rep);
        CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
        CHECK_CONTAINS(st.error_message(), "unknown sequence 0");
    }
    {
        v1::ForwardReply rep;
        CHECK(forward(0, tokens, &rep).ok());  // still serving after the errors
    }
}

TEST_CASE("the engine runs every call on its one thread, answers each caller, and refuses once stopped") {
    baton::Shard * shard = service_shard();
    baton::Engine engine(shard, baton::EngineConfig{});
    constexpr int kCallers = 8;
    std::vector<std::thread::id> ran_on(kCallers);
    std::vector<baton::ShardStatus> answers(kCallers);
    std::vector<std::thread> callers;
    for (int i = 0; i < kCallers; ++i) {
        callers.emplace_back([&, i] {
            answers[i] = engine.call(baton::QueuedKind::kOperation, 0, [&, i](baton::Shard & s) {
                ran_on[i] = std::this_thread::get_id();
                return i % 2 == 0 ? baton::ShardStatus::Ok() : s.remove_sequence(999, nullptr);  // a refusal
            });
        });
    }
    for (std::thread & t : callers) {
        t.join();
    }
    for (int i = 0; i < kCallers; ++i) {
        CAPTURE(i);
        CHECK(ran_on[i] == ran_on[0]);  // one thread ...
        CHECK(ran_on[i] != std::thread::id{});
        CHECK(answers[i].ok() == (i % 2 == 0));  // ... and each caller its own answer
    }
    CHECK(engine.batches() == kCallers);
    const baton::ShardStatus thrown = engine.call(baton::QueuedKind::kOperation, 0, [](baton::Shard &) -> baton::ShardStatus {
        throw std::runtime_error("a job that throws");
    });
    CHECK(thrown.code == baton::ErrorCode::kInternal);
    CHECK_CONTAINS(thrown.message, "a job that throws");
    engine.stop();
    const baton::ShardStatus refused =
        engine.call(baton::QueuedKind::kOperation, 0, [](baton::Shard &) { return baton::ShardStatus::Ok(); });
    CHECK(refused.code == baton::ErrorCode::kFailedPrecondition);
    CHECK_CONTAINS(refused.message, "stopping");
}

}  // TEST_SUITE("service")

// ---------------------------------------------------------------------------------------------
// Vocab-only tests

namespace {

// Writes the first data_offset bytes of src to dest, then (sparse) extends dest to src's size.
void write_metadata_copy(const char * src, const std::string & dest, bool sparse_to_full_size) {
    gguf_init_params params{};
    params.no_alloc = true;
    params.ctx = nullptr;
    gguf_context * meta = gguf_init_from_file(src, params);
    REQUIRE(meta != nullptr);
    const size_t data_offset = gguf_get_data_offset(meta);
    gguf_free(meta);

    struct stat st {};
    REQUIRE(::stat(src, &st) == 0);
    REQUIRE(static_cast<size_t>(st.st_size) > data_offset);
    std::FILE * in = std::fopen(src, "rb");
    REQUIRE(in != nullptr);
    std::string prefix(data_offset, '\0');
    const size_t got = std::fread(prefix.data(), 1, prefix.size(), in);
    std::fclose(in);
    REQUIRE(got == prefix.size());
    const int fd = ::open(dest.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    const bool written = ::write(fd, prefix.data(), prefix.size()) == static_cast<ssize_t>(prefix.size());
    const bool extended = !sparse_to_full_size || ::ftruncate(fd, st.st_size) == 0;
    ::close(fd);
    REQUIRE(written);
    REQUIRE(extended);
}

// A vocab-only Shard on a sparse metadata-only copy of BATON_TEST_MODEL (the copy is removed once
// loaded), and the whole model beside it.
struct VocabShards {
    std::unique_ptr<baton::Shard> vocab;
    std::unique_ptr<baton::Shard> whole;
};

VocabShards & vocab_shards() {
    static VocabShards shards;
    if (!shards.vocab) {
        const char * model = test_model();
        const std::string sparse_path = "/tmp/baton-worker-test-" + std::to_string(::getpid()) + "-sparse.gguf";
        write_metadata_copy(model, sparse_path, true);
        baton::ShardConfig config;
        config.model_path = sparse_path;
        config.vocab_only = true;
        std::unique_ptr<baton::Shard> vocab;
        try {
            vocab = std::make_unique<baton::Shard>(config);
        } catch (const std::exception & e) {
            ::unlink(sparse_path.c_str());
            FAIL("cannot load the vocabulary of the sparse copy: " << std::string(e.what()));
        }
        ::unlink(sparse_path.c_str());
        shards.whole = load(model, 0, -1);
        shards.vocab = std::move(vocab);
    }
    return shards;
}

}  // namespace

TEST_SUITE("vocab") {

TEST_CASE("a copy cut at data_offset is refused (llama.cpp checks every tensor against the file size)") {
    const std::string cut_path = "/tmp/baton-worker-test-" + std::to_string(::getpid()) + "-cut.gguf";
    write_metadata_copy(test_model(), cut_path, false);
    baton::ShardConfig config;
    config.model_path = cut_path;
    config.vocab_only = true;
    std::string refusal;
    bool loaded = false;
    try {
        baton::Shard cut(config);
        loaded = true;
    } catch (const baton::ShardLoadError & e) {
        refusal = e.what();
    }
    ::unlink(cut_path.c_str());
    CHECK_MESSAGE(!loaded, "a copy cut at data_offset loaded");
    CHECK_CONTAINS(refusal, "data is not within the file bounds");
}

TEST_CASE("a vocab-only shard describes itself like the whole model, without layers") {
    VocabShards & s = vocab_shards();
    const baton::ShardInfo & vi = s.vocab->info();
    const baton::ShardInfo & wi = s.whole->info();
    CHECK(vi.vocab_only);
    CHECK_FALSE(wi.vocab_only);
    CHECK(vi.architecture == wi.architecture);
    CHECK(vi.n_vocab == wi.n_vocab);
    CHECK(vi.n_vocab > 0);
    CHECK(vi.eog_token_ids == wi.eog_token_ids);
    CHECK(vi.model_sha256.empty());  // not hashed unless given
    CHECK(vi.n_layer == 0);
    CHECK(vi.kv_bytes == 0);
    CHECK(vi.weight_bytes == 0);
    CHECK(vi.n_seq_max == 0);
    CHECK(vi.recipe_hash.empty());
    CHECK(vi.vocabulary_piece_bytes == wi.vocabulary_piece_bytes);
    CHECK(vi.vocabulary_piece_bytes > 0);
}

TEST_CASE("a vocab-only shard tokenizes, lists its vocabulary and detokenizes like the whole model") {
    VocabShards & s = vocab_shards();
    baton::Shard * vocab = s.vocab.get();
    baton::Shard * whole = s.whole.get();
    const baton::ShardInfo & vi = vocab->info();
    const std::string text = "Hello world, \xF0\x9F\x99\x82 \xE4\xBD\xA0\xE5\xA5\xBD";  // emoji, CJK
    for (bool add_special : {false, true}) {
        CAPTURE(add_special);
        std::vector<int32_t> a;
        std::vector<int32_t> b;
        CHECK_OK(vocab->tokenize(text, add_special, false, &a));
        CHECK_OK(whole->tokenize(text, add_special, false, &b));
        CHECK(a == b);
        CHECK_FALSE(a.empty());
    }
    baton::ShardVocabulary va;
    baton::ShardVocabulary wa;
    CHECK_OK(vocab->vocabulary(&va));
    CHECK_OK(whole->vocabulary(&wa));
    CHECK(va.pieces.size() == vi.n_vocab);
    CHECK(va.attrs.size() == vi.n_vocab);
    CHECK(va.pieces == wa.pieces);
    CHECK(va.attrs == wa.attrs);
    CHECK(va.bos_token_id == wa.bos_token_id);
    CHECK(va.add_bos == wa.add_bos);
    CHECK(va.eog_token_ids == vi.eog_token_ids);
    std::vector<int32_t> ids;
    CHECK_OK(vocab->tokenize(text, false, false, &ids));
    std::string joined;
    for (int32_t t : ids) {
        joined += va.pieces.at(static_cast<size_t>(t));
    }
    std::string detok;
    CHECK_OK(vocab->detokenize(ids, false, false, &detok));
    CHECK(joined == detok);
}

TEST_CASE("a vocab-only shard refuses Forward and the sequence calls") {
    baton::Shard * vocab = vocab_shards().vocab.get();
    std::vector<ForwardOutput> outputs;
    int32_t next = -1;
    CHECK_STATUS(vocab->forward({token_entry(0, 0, {1, 2})}, &outputs), ErrorCode::kFailedPrecondition,
                 baton::kVocabOnlyRefusal);
    CHECK_STATUS(vocab->remove_sequence(0, &next), ErrorCode::kFailedPrecondition, baton::kVocabOnlyRefusal);
    CHECK_STATUS(vocab->trim_sequence(0, 0, &next), ErrorCode::kFailedPrecondition, baton::kVocabOnlyRefusal);
    CHECK_STATUS(vocab->copy_sequence(0, 1, &next), ErrorCode::kFailedPrecondition, baton::kVocabOnlyRefusal);
    CHECK(next == -1);
    CHECK(outputs.empty());
}

// Info says vocab_only and holds no boundary schema; the Vocabulary reply fits the send limit the
// server is built with; Forward is refused.
TEST_CASE("the service over a vocab-only shard: Info, Vocabulary within the send limit, Forward refused") {
    VocabShards & s = vocab_shards();
    const baton::ShardInfo & vi = s.vocab->info();
    const baton::ShardInfo & wi = s.whole->info();
    baton::ShardWorkerService service(s.vocab.get());
    v1::InfoRequest info_req;
    info_req.set_schema_version(1);
    v1::InfoReply info_rep;
    CHECK(service.Info(nullptr, &info_req, &info_rep).ok());
    CHECK(info_rep.vocab_only());
    CHECK_FALSE(info_rep.has_boundary());
    CHECK(info_rep.n_vocab() == vi.n_vocab);
    v1::VocabularyRequest vocab_req;
    v1::VocabularyReply vocab_rep;
    CHECK(service.Vocabulary(nullptr, &vocab_req, &vocab_rep).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    vocab_req.set_schema_version(1);
    vocab_rep.Clear();
    CHECK(service.Vocabulary(nullptr, &vocab_req, &vocab_rep).ok());
    CHECK(vocab_rep.n_vocab() == vi.n_vocab);
    CHECK(static_cast<uint32_t>(vocab_rep.pieces_size()) == vi.n_vocab);
    CHECK(vocab_rep.ByteSizeLong() <= baton::vocabulary_reply_bytes(vi));
    CHECK(static_cast<uint64_t>(baton::max_send_message_bytes(vi)) >= baton::vocabulary_reply_bytes(vi));
    CHECK(static_cast<uint64_t>(baton::max_send_message_bytes(wi)) >= baton::vocabulary_reply_bytes(wi));
    v1::ForwardRequest fwd_req;
    fwd_req.set_schema_version(1);
    v1::ForwardReply fwd_rep;
    const grpc::Status refused = service.Forward(nullptr, &fwd_req, &fwd_rep);
    CHECK(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_CONTAINS(refused.error_message(), baton::kVocabOnlyRefusal);
}

}  // TEST_SUITE("vocab")

// ---------------------------------------------------------------------------------------------

// `baton-worker-tests [MODE] [doctest options]`: runs the suite MODE (default validation); a model
// mode without BATON_TEST_MODEL exits 77, which ctest reports as skipped.
int main(int argc, char ** argv) {
    std::string mode = "validation";
    int first_option = 1;
    if (argc > 1 && argv[1][0] != '-') {
        mode = argv[1];
        first_option = 2;
    }
    if (mode != "validation" && mode != "model" && mode != "service" && mode != "vocab") {
        std::fprintf(stderr, "usage: baton-worker-tests [validation|model|service|vocab] [doctest options]\n");
        return 2;
    }
    if (mode != "validation") {
        const char * model = std::getenv("BATON_TEST_MODEL");
        if (model == nullptr || *model == '\0') {
            std::fprintf(stderr, "BATON_TEST_MODEL is not set: skipping %s\n", mode.c_str());
            return 77;
        }
    }
    std::vector<const char *> args = {argv[0]};
    for (int i = first_option; i < argc; ++i) {
        args.push_back(argv[i]);
    }
    doctest::Context context;
    context.setOption("test-suite", mode.c_str());
    context.applyCommandLine(static_cast<int>(args.size()), args.data());
    return context.run();
}
