/* Exit 0 when this process may run AMX tile code the way ggml's AMX backend does: the kernel grants the tile
   data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) and a tile config, load, int8 dot product,
   store and release run and give the right sum. Exit 2 when the permission is refused, 3 on a wrong sum; a VM
   that lists AMX in cpuid but faults on the instructions kills it with SIGILL. build_llama_server.sh builds
   llama.cpp without its AMX code unless this exits 0. Compile: cc -O1 -mamx-tile -mamx-int8 amx_probe.c */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        perror("amx_probe: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused");
        return 2;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    static int8_t a[16 * 64], b[16 * 64];
    static int32_t out[16 * 16];
    for (int i = 0; i < 16 * 64; i++) {
        a[i] = 1;
        b[i] = 2;
    }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, out, 64);
    _tile_release();
    if (out[0] != 128) {
        fprintf(stderr, "amx_probe: tile int8 dot product gave %d, want 128\n", out[0]);
        return 3;
    }
    puts("amx_probe: AMX tiles usable");
    return 0;
}
