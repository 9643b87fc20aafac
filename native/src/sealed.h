// Sealing the data plane's frames (protocol/worker.proto, DataFrame): AES-256-GCM under a
// 32-byte session key, nonce = kind (u32 LE) || counter (u64 LE), associated data =
// "baton-data/1" || kind (u32 LE) || session_id || counter (u64 LE). agent/core/wire/data_frames.py
// is the same construction in Python; the tests check the two against each other.
//
// Pure: no state, no I/O; OpenSSL's EVP interface only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace baton {

inline constexpr size_t kDataKeyBytes = 32;    // AES-256
inline constexpr size_t kDataTagBytes = 16;    // GCM tag, appended to the ciphertext
inline constexpr size_t kDataSessionIdBytes = 16;

// The associated data of a frame (what binds the clear envelope fields to the sealed body).
std::string data_frame_aad(uint32_t kind, std::string_view session_id, uint64_t counter);

// Seals plain into *sealed (ciphertext || tag). False only on a key of the wrong size or an
// OpenSSL failure.
bool seal_data_frame(std::string_view key, uint32_t kind, std::string_view session_id, uint64_t counter,
                     std::string_view plain, std::string * sealed);

// Opens what seal_data_frame made with the same key, kind, session id and counter into
// *plain. False (and *plain unspecified) when anything differs or the bytes were changed.
bool open_data_frame(std::string_view key, uint32_t kind, std::string_view session_id, uint64_t counter,
                     std::string_view sealed, std::string * plain);

}  // namespace baton
