// LD_PRELOAD: make this process see a smaller x86 CPU, by having cpuid fault (arch_prctl ARCH_SET_CPUID) and
// answering it in a SIGSEGV handler with feature bits cleared. VITKIT_AS_CPU=avx2 (default): no AVX-512, VNNI, AMX
// or AVX512-BF16, as an AMD EPYC Zen 2/3; VITKIT_AS_CPU=avx512: AVX-512 kept, VNNI, AMX, AVX512-BF16 and FP16
// cleared, as a Skylake-SP Xeon; VITKIT_AS_CPU=avx512vnni: the same with AVX512-VNNI kept, as a Cascade Lake. The setting is per thread and inherited by threads and child processes started
// later (Inductor's compiler runs too). A program's own SIGSEGV handler (gcc's, Python's faulthandler) is kept aside
// by the signal/sigaction wrappers below and called for every fault that is not a cpuid. See as_cpu_kind.sh.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <asm/prctl.h>

#define BIT(n) (1u << (n))

static int keep_avx512, keep_vnni;
static struct sigaction program_action;  // the SIGSEGV handler the program asked for (SIG_DFL until it asks)

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);

static sigaction_fn real_sigaction(void) {
  static sigaction_fn fn;
  if (!fn) fn = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  return fn;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  if (sig != SIGSEGV) return real_sigaction()(sig, act, old);
  if (old) *old = program_action;
  if (act) program_action = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof act);
  act.sa_handler = handler;
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void handler(int sig, siginfo_t *si, void *ctx_) {
  ucontext_t *ctx = (ucontext_t *)ctx_;
  greg_t *g = ctx->uc_mcontext.gregs;
  unsigned char *ip = (unsigned char *)g[REG_RIP];
  if (!(ip[0] == 0x0F && ip[1] == 0xA2)) {  // not cpuid: a real fault, for the program's handler or the default
    if (program_action.sa_flags & SA_SIGINFO) {
      program_action.sa_sigaction(sig, si, ctx_);
    } else if (program_action.sa_handler != SIG_DFL && program_action.sa_handler != SIG_IGN) {
      program_action.sa_handler(sig);
    } else {
      struct sigaction dfl;
      memset(&dfl, 0, sizeof dfl);
      dfl.sa_handler = SIG_DFL;
      real_sigaction()(SIGSEGV, &dfl, 0);  // the instruction faults again, now with the default action
    }
    return;
  }
  uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  real_cpuid(leaf, sub, r);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  if (leaf == 7 && sub == 0) {
    // EBX: AVX512 F, DQ, IFMA, PF, ER, CD, BW, VL
    if (!keep_avx512) r[1] &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
    // ECX: AVX512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ (VNNI kept for avx512vnni only)
    r[2] &= keep_avx512 ? (keep_vnni ? ~0u : ~BIT(11)) : ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
    // EDX: AVX512 4VNNIW, 4FMAPS, VP2INTERSECT, AMX-BF16, AVX512-FP16, AMX-TILE, AMX-INT8
    r[3] &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
  } else if (leaf == 7 && sub == 1) {
    r[0] &= ~(BIT(4) | BIT(5) | BIT(21) | BIT(23));  // EAX: AVX-VNNI, AVX512-BF16, AMX-FP16, AVX-IFMA
  } else if (leaf == 0xD && sub == 0) {
    r[0] &= ~((keep_avx512 ? 0 : BIT(5) | BIT(6) | BIT(7)) | BIT(17) | BIT(18));  // AVX-512 / AMX register state
  }
  g[REG_RAX] = r[0]; g[REG_RBX] = r[1]; g[REG_RCX] = r[2]; g[REG_RDX] = r[3];
  g[REG_RIP] += 2;  // past the cpuid instruction
}

__attribute__((constructor)) static void init(void) {
  const char *as = getenv("VITKIT_AS_CPU");
  keep_vnni = as && strcmp(as, "avx512vnni") == 0;
  keep_avx512 = keep_vnni || (as && strcmp(as, "avx512") == 0);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  program_action.sa_handler = SIG_DFL;
  real_sigaction()(SIGSEGV, &sa, 0);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}
