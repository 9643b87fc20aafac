// Shard's vocabulary side (shard.h): tokenize, detokenize, the whole vocabulary, and the facts
// about it that loading reports (shard_vocab.h).
#include "shard.h"
#include "shard_vocab.h"

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "llama.h"

namespace baton {

namespace {

bool token_piece(const llama_vocab * vocab, llama_token token, std::string * piece) {
    char small[64];
    int32_t n = llama_token_to_piece(vocab, token, small, static_cast<int32_t>(sizeof(small)), 0, false);
    if (n >= 0) {
        piece->assign(small, static_cast<size_t>(n));
        return true;
    }
    piece->assign(static_cast<size_t>(-static_cast<int64_t>(n)), '\0');
    n = llama_token_to_piece(vocab, token, piece->data(), static_cast<int32_t>(piece->size()), 0, false);
    if (n < 0) {
        return false;
    }
    piece->resize(static_cast<size_t>(n));
    return true;
}

}  // namespace

// The vocabulary facts every shard reports: n_vocab, EOG ids, the pieces' total length.
void describe_vocabulary(const llama_vocab * vocab, ShardInfo * info) {
    info->n_vocab = static_cast<uint32_t>(llama_vocab_n_tokens(vocab));
    info->eog_token_ids.clear();
    info->vocabulary_piece_bytes = 0;
    std::string piece;
    for (llama_token t = 0; t < static_cast<llama_token>(info->n_vocab); ++t) {
        if (llama_vocab_is_eog(vocab, t)) {
            info->eog_token_ids.push_back(t);
        }
        if (!token_piece(vocab, t, &piece)) {
            throw ShardLoadError("llama_token_to_piece fails for token " + std::to_string(t));
        }
        info->vocabulary_piece_bytes += piece.size();
    }
}

ShardStatus Shard::tokenize(const std::string & text, bool add_special, bool parse_special,
                            std::vector<int32_t> * tokens) const {
    if (text.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
        return ShardStatus::Invalid("text of " + std::to_string(text.size()) + " bytes is too long to tokenize");
    }
    const int32_t text_len = static_cast<int32_t>(text.size());
    std::vector<llama_token> buf(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), text_len, buf.data(), static_cast<int32_t>(buf.size()),
                               add_special, parse_special);
    if (n == std::numeric_limits<int32_t>::min()) {
        return ShardStatus::Invalid("tokenization of " + std::to_string(text.size()) + " bytes overflows");
    }
    if (n < 0) {  // buffer too small: -n is the size needed
        buf.resize(static_cast<size_t>(-static_cast<int64_t>(n)));
        n = llama_tokenize(vocab_, text.data(), text_len, buf.data(), static_cast<int32_t>(buf.size()), add_special,
                           parse_special);
        if (n < 0) {
            return ShardStatus::Internal("llama_tokenize returned " + std::to_string(n));
        }
    }
    buf.resize(static_cast<size_t>(n));
    *tokens = std::move(buf);
    return ShardStatus::Ok();
}

ShardStatus Shard::detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special,
                              std::string * text) const {
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= info_.n_vocab) {
            return ShardStatus::Invalid("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                        " is outside [0, " + std::to_string(info_.n_vocab) + ")");
        }
    }
    if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
        return ShardStatus::Invalid("too many tokens");
    }
    const int32_t n_tokens = static_cast<int32_t>(tokens.size());
    std::string buf(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), n_tokens, buf.data(), static_cast<int32_t>(buf.size()),
                                 remove_special, unparse_special);
    if (n < 0) {  // buffer too small: -n is the size needed
        if (n == std::numeric_limits<int32_t>::min()) {
            return ShardStatus::Invalid("detokenized text would be too long");
        }
        buf.resize(static_cast<size_t>(-static_cast<int64_t>(n)));
        n = llama_detokenize(vocab_, tokens.data(), n_tokens, buf.data(), static_cast<int32_t>(buf.size()),
                             remove_special, unparse_special);
        if (n < 0) {
            return ShardStatus::Internal("llama_detokenize returned " + std::to_string(n));
        }
    }
    buf.resize(static_cast<size_t>(n));
    *text = std::move(buf);
    return ShardStatus::Ok();
}

ShardStatus Shard::vocabulary(ShardVocabulary * out) const {
    ShardVocabulary v;
    v.pieces.resize(info_.n_vocab);
    v.attrs.resize(info_.n_vocab);
    for (llama_token t = 0; t < static_cast<llama_token>(info_.n_vocab); ++t) {
        if (!token_piece(vocab_, t, &v.pieces[static_cast<size_t>(t)])) {
            return ShardStatus::Internal("llama_token_to_piece fails for token " + std::to_string(t));
        }
        v.attrs[static_cast<size_t>(t)] = static_cast<uint32_t>(llama_vocab_get_attr(vocab_, t));
    }
    const llama_token bos = llama_vocab_bos(vocab_);
    v.bos_token_id = bos == LLAMA_TOKEN_NULL ? -1 : bos;
    v.add_bos = llama_vocab_get_add_bos(vocab_);
    v.eog_token_ids = info_.eog_token_ids;
    *out = std::move(v);
    return ShardStatus::Ok();
}

}  // namespace baton
