// CTest cases for the last hop's draw (native/src/sampling.h): the uniforms' bits, ties, the
// top-k and top-p cuts, -inf, and the refusals. No model, no threads.
//
// `baton-sampling-tests draw` instead reads cases from stdin, one a line, and prints one answer
// a line (tests/test_sampling_native.py feeds it the rows it gives agent/core/owner/sampling.py):
//   R T top_k top_p uniform n v_0 .. v_{n-1}              the token drawn from a whole row
//   K T top_k top_p uniform k n_vocab id_0 .. id_{k-1} v_0 .. v_{k-1}   from a top-K record
//   U seed position                                       draw_uniform, as %a
// Numbers as C's strtod reads them (Python's float.hex); an answer that fails is "error: why".
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "sampling.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using baton::draw_token;
using baton::draw_token_top_k;
using baton::draw_uniform;
using baton::SamplingParams;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

int32_t drawn(const std::vector<float> & row, SamplingParams params, double uniform) {
    int32_t token = -1;
    std::string error;
    REQUIRE_MESSAGE(draw_token(row.data(), row.size(), params, uniform, &token, &error), error);
    return token;
}

std::string refusal(const std::vector<float> & row, SamplingParams params, double uniform) {
    int32_t token = -1;
    std::string error;
    CHECK_FALSE(draw_token(row.data(), row.size(), params, uniform, &token, &error));
    return error;
}

}  // namespace

TEST_CASE("the uniforms are SplitMix64's, as agent/core/owner/sampling.py draw_uniform gives them") {
    // values printed by draw_uniform in Python (float.hex)
    CHECK(draw_uniform(0, 0) == 0x1.c4415072f63b9p-1);  // SplitMix64(0)'s first output 0xE220A8397B1DCDAF
    CHECK(draw_uniform(42, 7) == 0x1.99ec6bdd3d3c5p-1);
    CHECK(draw_uniform(18446744073709551615ULL, 1000) == 0x1.6eb1ee2894fc4p-1);
    CHECK(draw_uniform(123456789, 0) == 0x1.11e3a6c9ef5b8p-3);
    for (int64_t p = 0; p < 1000; ++p) {
        const double u = draw_uniform(7, p);
        REQUIRE(u >= 0.0);
        REQUIRE(u < 1.0);
    }
}

TEST_CASE("pairwise_sum adds in numpy's order") {
    const std::vector<double> small = {1e16, 1.0, -1e16};
    CHECK(baton::pairwise_sum(small.data(), small.size()) == 0.0);  // in order: the 1 is lost
    std::vector<double> many(1000, 0.1);
    double sequential = 0.0;
    for (double v : many) {
        sequential += v;
    }
    CHECK(sequential == 0x1.8ffffffffff9dp+6);
    CHECK(baton::pairwise_sum(many.data(), many.size()) == 0x1.9000000000001p+6);  // numpy's np.full(1000, 0.1).sum()
}

TEST_CASE("greedy is the argmax, the lowest id on ties, and ignores the uniform") {
    CHECK(drawn({0.f, 3.f, 3.f, 1.f}, {}, 0.99) == 1);
    CHECK(drawn({kMinusInf, -5.f}, {}, 0.0) == 1);
}

TEST_CASE("equal logits are ordered by id: the uniform picks its stretch") {
    const SamplingParams params{1.0, 0, 1.0};
    CHECK(drawn({2.f, 2.f}, params, 0.25) == 0);
    CHECK(drawn({2.f, 2.f}, params, 0.75) == 1);
    CHECK(drawn({2.f, 2.f, 2.f, 2.f}, {1.0, 2, 1.0}, 0.9) == 1);  // the top-2 of four ties: ids 0, 1
}

TEST_CASE("top_p keeps the smallest prefix reaching it, exactly at a tie") {
    // two equal weights: the first alone reaches 0.5 of the total
    CHECK(drawn({0.f, 0.f}, {1.0, 0, 0.5}, 0.99) == 0);
    CHECK(drawn({0.f, 0.f}, {1.0, 0, 0.51}, 0.99) == 1);
    CHECK(drawn({0.f, 0.f, 0.f, -1.f}, {1.0, 3, 0.5}, 0.99) == 1);  // the top-k path: two of three
}

TEST_CASE("a top-k cut draws among the k most likely only") {
    const std::vector<float> row = {3.f, 2.f, 1.f, 0.f, 2.5f};
    for (int i = 0; i < 100; ++i) {
        const int32_t t = drawn(row, {5.0, 2, 1.0}, i / 100.0);
        CHECK((t == 0 || t == 4));
    }
}

TEST_CASE("-inf is never drawn, at any temperature") {
    const std::vector<float> row = {kMinusInf, 0.f, kMinusInf, 0.f};
    for (const double temperature : {0.01, 1.0, 100.0}) {
        for (int i = 0; i < 50; ++i) {
            const int32_t t = drawn(row, {temperature, 0, 1.0}, i / 50.0);
            CHECK((t == 1 || t == 3));
        }
    }
}

TEST_CASE("a cold draw takes the peak, a hot one spreads") {
    const std::vector<float> row = {1.f, 4.f, 2.f};
    CHECK(drawn(row, {1e-3, 0, 1.0}, 0.999999) == 1);
    CHECK(drawn(row, {1e6, 0, 1.0}, 0.0) == 1);   // the first stretch is the peak
    CHECK(drawn(row, {1e6, 0, 1.0}, 0.999) == 0);  // nearly flat: the last in candidate order
}

TEST_CASE("a top-K record draws as the row when it covers the cut") {
    const std::vector<float> row = {0.5f, 3.f, 1.f, 3.f, -2.f, 2.f};
    const std::vector<int32_t> ids = {1, 3, 5, 2};  // select_top_k's order: logit, then id
    const std::vector<float> values = {3.f, 3.f, 2.f, 1.f};
    for (int i = 0; i < 100; ++i) {
        const double u = (i + 0.5) / 100.0;
        for (const SamplingParams params : {SamplingParams{0.7, 3, 1.0}, SamplingParams{1.3, 4, 0.8}}) {
            int32_t from_record = -1;
            std::string error;
            REQUIRE(draw_token_top_k(ids.data(), values.data(), ids.size(), row.size(), params, u, &from_record, &error));
            CHECK(from_record == drawn(row, params, u));
        }
    }
}

TEST_CASE("bad rows, parameters and records are refused with a reason") {
    CHECK(refusal({}, {1.0, 0, 1.0}, 0.5).find("non-empty") != std::string::npos);
    CHECK(refusal({0.f, std::nanf("")}, {1.0, 0, 1.0}, 0.5).find("NaN") != std::string::npos);
    CHECK(refusal({kMinusInf, kMinusInf}, {1.0, 0, 1.0}, 0.5).find("-inf") != std::string::npos);
    CHECK(refusal({0.f, 1.f}, {1.0, 0, 1.0}, 1.0).find("uniform") != std::string::npos);
    CHECK(refusal({0.f, 1.f}, {-1.0, 0, 1.0}, 0.5).find("temperature") != std::string::npos);
    CHECK(refusal({0.f, 1.f}, {1.0, 0, 0.0}, 0.5).find("top_p") != std::string::npos);
    const int32_t ids[] = {1};
    const float values[] = {1.f};
    int32_t token = -1;
    std::string error;
    CHECK_FALSE(draw_token_top_k(ids, values, 1, 2, {1.0, 0, 1.0}, 0.5, &token, &error));
    CHECK(error.find("full row") != std::string::npos);
    CHECK_FALSE(draw_token_top_k(ids, values, 1, 2, {1.0, 2, 1.0}, 0.5, &token, &error));
    CHECK(error.find("top_k 2") != std::string::npos);
}

namespace {

// One stdin case (see the top of the file): the answer line.
std::string answer(const std::string & line) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    auto number = [&]() {
        std::string word;
        in >> word;
        return std::strtod(word.c_str(), nullptr);
    };
    char text[64];
    if (kind == "U") {
        std::string seed, position;
        in >> seed >> position;
        std::snprintf(text, sizeof text, "%a",
                      draw_uniform(std::strtoull(seed.c_str(), nullptr, 10), std::strtoll(position.c_str(), nullptr, 10)));
        return text;
    }
    SamplingParams params;
    params.temperature = number();
    params.top_k = static_cast<uint32_t>(number());
    params.top_p = number();
    const double uniform = number();
    int32_t token = -1;
    std::string error;
    bool ok = false;
    if (kind == "R") {
        std::vector<float> row(static_cast<size_t>(number()));
        for (float & v : row) {
            v = static_cast<float>(number());
        }
        ok = draw_token(row.data(), row.size(), params, uniform, &token, &error);
    } else if (kind == "K") {
        const size_t k = static_cast<size_t>(number());
        const size_t n_vocab = static_cast<size_t>(number());
        std::vector<int32_t> ids(k);
        std::vector<float> values(k);
        for (int32_t & id : ids) {
            id = static_cast<int32_t>(number());
        }
        for (float & v : values) {
            v = static_cast<float>(number());
        }
        ok = draw_token_top_k(ids.data(), values.data(), k, n_vocab, params, uniform, &token, &error);
    } else {
        return "error: unknown case " + kind;
    }
    return ok ? std::to_string(token) : "error: " + error;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc > 1 && std::string(argv[1]) == "draw") {
        std::string line;
        while (std::getline(std::cin, line)) {
            std::cout << answer(line) << '\n';
        }
        return 0;
    }
    doctest::Context context(argc, argv);
    return context.run();
}
