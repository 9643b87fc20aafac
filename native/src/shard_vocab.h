// The vocabulary facts a Shard reports when it loads (shard_vocab.cpp).
#pragma once

#include "shard.h"

#include "llama.h"

namespace baton {

// Fills info's n_vocab, EOG token ids and the pieces' total length; throws ShardLoadError when
// a token has no piece.
void describe_vocabulary(const llama_vocab * vocab, ShardInfo * info);

}  // namespace baton
