#include "sha256.h"

#include <openssl/evp.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

namespace baton {
namespace {

struct MdCtxDeleter {
    void operator()(EVP_MD_CTX * ctx) const { EVP_MD_CTX_free(ctx); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxDeleter>;

struct FileCloser {
    void operator()(std::FILE * f) const { std::fclose(f); }
};

MdCtx new_sha256() {
    MdCtx ctx(EVP_MD_CTX_new());
    if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
        throw std::runtime_error("sha256: EVP_DigestInit_ex failed");
    }
    return ctx;
}

std::string finish_hex(EVP_MD_CTX * ctx) {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(ctx, digest, &n) != 1) {
        throw std::runtime_error("sha256: EVP_DigestFinal_ex failed");
    }
    static const char * hex = "0123456789abcdef";
    std::string out;
    out.reserve(2 * n);
    for (unsigned int i = 0; i < n; ++i) {
        out.push_back(hex[digest[i] >> 4]);
        out.push_back(hex[digest[i] & 15]);
    }
    return out;
}

}  // namespace

std::string sha256_hex(std::string_view data) {
    MdCtx ctx = new_sha256();
    if (EVP_DigestUpdate(ctx.get(), data.data(), data.size()) != 1) {
        throw std::runtime_error("sha256: EVP_DigestUpdate failed");
    }
    return finish_hex(ctx.get());
}

std::string sha256_file_hex(const std::string & path) {
    std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) {
        throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
    }
    MdCtx ctx = new_sha256();
    std::vector<char> buf(1 << 20);
    for (;;) {
        const size_t n = std::fread(buf.data(), 1, buf.size(), f.get());
        if (n > 0 && EVP_DigestUpdate(ctx.get(), buf.data(), n) != 1) {
            throw std::runtime_error("sha256: EVP_DigestUpdate failed");
        }
        if (n < buf.size()) {
            if (std::ferror(f.get())) {
                throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
            }
            break;
        }
    }
    return finish_hex(ctx.get());
}

bool is_sha256_hex(const std::string & text) {
    if (text.size() != 64) {
        return false;
    }
    for (char c : text) {
        const bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
        if (!hex) {
            return false;
        }
    }
    return true;
}

}  // namespace baton
