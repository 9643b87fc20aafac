// Sealing the data plane's frames: see sealed.h.
#include "sealed.h"

#include <memory>

#include <openssl/evp.h>

namespace baton {

namespace {

constexpr std::string_view kAadLabel = "baton-data/1";
constexpr size_t kNonceBytes = 12;

void put_le(std::string * out, uint64_t value, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) {
        out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
    }
}

std::string nonce_of(uint32_t kind, uint64_t counter) {
    std::string nonce;
    nonce.reserve(kNonceBytes);
    put_le(&nonce, kind, 4);
    put_le(&nonce, counter, 8);
    return nonce;
}

struct CtxFree {
    void operator()(EVP_CIPHER_CTX * ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
using Ctx = std::unique_ptr<EVP_CIPHER_CTX, CtxFree>;

const unsigned char * bytes(std::string_view s) { return reinterpret_cast<const unsigned char *>(s.data()); }

}  // namespace

std::string data_frame_aad(uint32_t kind, std::string_view session_id, uint64_t counter) {
    std::string aad(kAadLabel);
    put_le(&aad, kind, 4);
    aad.append(session_id);
    put_le(&aad, counter, 8);
    return aad;
}

bool seal_data_frame(std::string_view key, uint32_t kind, std::string_view session_id, uint64_t counter,
                     std::string_view plain, std::string * sealed) {
    if (key.size() != kDataKeyBytes) {
        return false;
    }
    Ctx ctx(EVP_CIPHER_CTX_new());
    const std::string nonce = nonce_of(kind, counter);
    const std::string aad = data_frame_aad(kind, session_id, counter);
    int len = 0;
    if (!ctx || EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(kNonceBytes), nullptr) != 1 ||
        EVP_EncryptInit_ex(ctx.get(), nullptr, nullptr, bytes(key), bytes(nonce)) != 1 ||
        EVP_EncryptUpdate(ctx.get(), nullptr, &len, bytes(aad), static_cast<int>(aad.size())) != 1) {
        return false;
    }
    sealed->resize(plain.size() + kDataTagBytes);
    unsigned char * out = reinterpret_cast<unsigned char *>(sealed->data());
    int written = 0;
    if (!plain.empty() &&
        EVP_EncryptUpdate(ctx.get(), out, &written, bytes(plain), static_cast<int>(plain.size())) != 1) {
        return false;
    }
    int tail = 0;
    if (EVP_EncryptFinal_ex(ctx.get(), out + written, &tail) != 1 ||
        static_cast<size_t>(written + tail) != plain.size() ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, static_cast<int>(kDataTagBytes),
                            out + plain.size()) != 1) {
        return false;
    }
    return true;
}

bool open_data_frame(std::string_view key, uint32_t kind, std::string_view session_id, uint64_t counter,
                     std::string_view sealed, std::string * plain) {
    if (key.size() != kDataKeyBytes || sealed.size() < kDataTagBytes) {
        return false;
    }
    const size_t n = sealed.size() - kDataTagBytes;
    Ctx ctx(EVP_CIPHER_CTX_new());
    const std::string nonce = nonce_of(kind, counter);
    const std::string aad = data_frame_aad(kind, session_id, counter);
    int len = 0;
    if (!ctx || EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(kNonceBytes), nullptr) != 1 ||
        EVP_DecryptInit_ex(ctx.get(), nullptr, nullptr, bytes(key), bytes(nonce)) != 1 ||
        EVP_DecryptUpdate(ctx.get(), nullptr, &len, bytes(aad), static_cast<int>(aad.size())) != 1) {
        return false;
    }
    plain->resize(n);
    unsigned char * out = reinterpret_cast<unsigned char *>(plain->data());
    int written = 0;
    if (n > 0 && EVP_DecryptUpdate(ctx.get(), out, &written, bytes(sealed), static_cast<int>(n)) != 1) {
        return false;
    }
    // the tag: EVP_CIPHER_CTX_ctrl takes a non-const pointer but only reads it for SET_TAG
    std::string tag(sealed.substr(n));
    int tail = 0;
    return EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, static_cast<int>(kDataTagBytes), tag.data()) == 1 &&
           EVP_DecryptFinal_ex(ctx.get(), out + written, &tail) == 1 && static_cast<size_t>(written + tail) == n;
}

}  // namespace baton
