// Which Zen (or Intel) a kernel runs on, for the prefetch choices that were measured to differ between hosts (the same
// code streams best with different prefetches on Zen 4, Zen 5 and an Intel Xeon with AMX; BENCHMARKS.md).
#pragma once
#include <cpuid.h>

namespace specdec {

enum class Host { kZen4, kZen5, kIntel, kOther };

// AMD family 19h with AVX-512 is Zen 4 (without it, Zen 3: kOther), 1Ah Zen 5; Intel with AVX-512 kIntel (measured
// on one whose hypervisor names it "Intel(R) Xeon(R) Processor", with AMX: Sapphire Rapids or later)
inline Host host() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return Host::kOther;
  const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
  const bool intel = ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "GenuineIntel"
  if (intel) {
    const bool avx512f = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (ebx >> 16 & 1);
    return avx512f ? Host::kIntel : Host::kOther;
  }
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return Host::kOther;
  const unsigned family = ((eax >> 8) & 0xF) + ((eax >> 20) & 0xFF);
  if (family == 0x1A) return Host::kZen5;
  const bool avx512f = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (ebx >> 16 & 1);
  return family == 0x19 && avx512f ? Host::kZen4 : Host::kOther;
}

}  // namespace specdec
