// xgrammar's types behind engine/sampling/token_grammar.h, for engine/sampling/token_grammar.cc and
// engine/sampling/token_constraint.cc only (the rest of the engine never sees the library).
#pragma once

#include "xgrammar/xgrammar.h"

namespace exl3::engine {

struct TokenGrammarImpl {
  xgrammar::CompiledGrammar compiled;
};

}  // namespace exl3::engine
