// CPU feature detection and the ember::isa_* ops that tell Python (and the start-up log) which tier runs.
// ISA: none (generic x86-64).
#include "common/cpu_isa.h"

#include <torch/library.h>

#include <atomic>
#include <cpuid.h>
#include <cstdlib>
#include <stdexcept>
#include <sys/syscall.h>
#include <unistd.h>

namespace ember {
namespace {

struct Features {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512bf16 = false, avx512vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_ymm = false, os_zmm = false, os_amx = false;
};

Features read_features() {
  Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  const bool osxsave = c & (1u << 27);
  if (osxsave) {  // the OS must save the wider registers on context switches, or using them corrupts state
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    f.os_ymm = (lo & 0x6) == 0x6;
    f.os_zmm = f.os_ymm && (lo & 0xE0) == 0xE0;
    f.os_amx = (lo & 0x60000) == 0x60000;  // XTILECFG (17) and XTILEDATA (18) in XCR0
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512bf16 = a & (1u << 5);
  return f;
}

bool cpu_runs(Isa isa, const Features& f) {
  const bool avx2 = f.os_ymm && f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.os_zmm && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAvx512Bf16: return avx512 && f.avx512bf16;
  }
  return false;
}

Isa choose_active() {
  const char* forced = std::getenv("EMBER_ISA");
  if (forced != nullptr && *forced != '\0') return parse_isa(forced);
  return supported_isas().front();
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    const Features f = read_features();
    return cpu_runs(Isa::kAvx512, f) && f.avx512vnni;
  }();
  return has;
}

bool cpu_has_amx_bf16() {
  static const bool has = [] {
    const Features f = read_features();
    if (!(cpu_runs(Isa::kAvx512Bf16, f) && f.amx_tile && f.amx_bf16 && f.os_amx)) return false;
    // Linux keeps AMX tile data off until a process asks (kernel 5.16+); the grant covers all its threads.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

bool cpu_has_amx_int8() {
  static const bool has = cpu_has_amx_bf16() && read_features().amx_int8;  // the tile-data grant is the same one
  return has;
}

std::vector<Isa> supported_isas() {
  static const std::vector<Isa> tiers = [] {
    const Features f = read_features();
    std::vector<Isa> out;
    for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kScalar})
      if (cpu_runs(isa, f)) out.push_back(isa);
    return out;
  }();
  return tiers;
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name != isa_name(isa)) continue;
    for (Isa ok : supported_isas())
      if (ok == isa) return isa;
    throw std::invalid_argument("EMBER_ISA=" + name + ": this CPU cannot run that tier (it runs " +
                                isa_name(supported_isas().front()) + " and below)");
  }
  throw std::invalid_argument("EMBER_ISA=" + name + " is not a tier: use avx2, avx512, avx512bf16 or scalar");
}

namespace {
std::atomic<int>& active_slot() {
  static std::atomic<int> slot{static_cast<int>(choose_active())};
  return slot;
}
}  // namespace

Isa active_isa() { return static_cast<Isa>(active_slot().load(std::memory_order_relaxed)); }

Isa select_isa(const std::string& name) {
  const Isa isa = parse_isa(name);
  active_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
  return isa;
}

namespace {

std::vector<std::string> isa_supported_op() {
  std::vector<std::string> out;
  for (Isa isa : supported_isas()) out.emplace_back(isa_name(isa));
  return out;
}

std::string isa_active_op() { return isa_name(active_isa()); }
bool isa_has_amx_op() { return cpu_has_amx_bf16(); }
bool isa_has_amx_int8_op() { return cpu_has_amx_int8(); }
std::string isa_select_op(const std::string& name) { return isa_name(select_isa(name)); }

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("isa_supported() -> str[]", &ember::isa_supported_op);
  m.def("isa_active() -> str", &ember::isa_active_op);
  m.def("isa_select(str name) -> str", &ember::isa_select_op);
  m.def("isa_has_amx() -> bool", &ember::isa_has_amx_op);
  m.def("isa_has_amx_int8() -> bool", &ember::isa_has_amx_int8_op);
}
