// Instruction-set tiers of Ember's kernels: which the CPU runs, and which one the ops dispatch to.
// ISA: none (generic x86-64; this header and cpu_isa.cpp must run on any CPU to find out what else can).
//
// Tiers are ordered: each one's CPU features include the one below it, so forcing a lower tier
// (EMBER_ISA=avx2 on an AVX512-BF16 machine) runs only instructions that CPU has.
#pragma once

#include <string>
#include <vector>

namespace ember {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* isa_name(Isa isa);
// Every tier this CPU can run, best first (kScalar is always last).
std::vector<Isa> supported_isas();
// The tier the dispatched ops use: the best supported one, or EMBER_ISA when set (or the last select_isa).
Isa active_isa();
// Makes `name` the active tier for every later call (start-up: EMBER_ISA; tests: each tier in turn).
Isa select_isa(const std::string& name);
// Whether the CPU has AVX512-VNNI (with the avx512 tier's F/BW/VL/DQ): picks ember::linear_q's kernel on the
// AVX-512 tiers, which do not otherwise require it (Skylake-SP has AVX-512 without VNNI).
bool cpu_has_avx512_vnni();
// Whether the CPU has AMX-BF16 tiles (with AVX512-BF16, the avx512bf16 tier) and Linux let this process use them
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), requested once on the first call): picks the AMX many-row
// paths of ember::linear_gguf and ember::linear_bf16 (common/amx_bf16.h).
bool cpu_has_amx_bf16();
// Whether it also has AMX-INT8 tiles (every AMX CPU so far): ember::linear_gguf's integer tile path for the
// 16-row layout (linear_gguf/linear_gguf_amx8.h).
bool cpu_has_amx_int8();
// Parses a tier name ("scalar", "avx2", "avx512", "avx512bf16"); throws for unknown or unsupported tiers.
Isa parse_isa(const std::string& name);

}  // namespace ember
