// sha256 helpers over OpenSSL EVP. Owns nothing; throws std::runtime_error on I/O errors.
#pragma once

#include <string>
#include <string_view>

namespace baton {

// Lower-case hex sha256 of a byte string.
std::string sha256_hex(std::string_view data);

// Lower-case hex sha256 of a file's contents, read in 1 MiB chunks.
std::string sha256_file_hex(const std::string & path);

// True when text is 64 hex digits.
bool is_sha256_hex(const std::string & text);

}  // namespace baton
