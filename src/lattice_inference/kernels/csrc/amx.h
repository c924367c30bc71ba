// Intel AMX tiles, shared by the bfloat16 products (tile_linear.cpp) and the quantized ones (quant_linear.cpp):
// whether this process may use them.
#pragma once

// Whether to run AMX where it is built and granted (the default; ``LATTICE_AMX=0`` turns it off through
// `prefer_amx`): set once, before any product.
inline bool& amx_preferred() {
  static bool preferred = true;
  return preferred;
}

#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

// Whether Linux granted this process the tiles' register state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA): it
// hands it out only on request. Asked once.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Whether products run on tiles in this process: preferred and granted.
inline bool amx_on() { return amx_preferred() && amx_granted(); }
#endif
