/* What an OpenMP parallel region and a barrier cost with 2 threads on this host (never in CI). The native decode
 * step opens about 5 regions per layer (q/k/v, attention, o, gate/up, down), so this bounds what one persistent
 * region per step could save.
 *
 *     gcc -O2 -fopenmp benchmarks/omp_region_cost.c -o /tmp/omp_cost && /tmp/omp_cost
 *
 * Prints five rounds of 20,000 empty regions and 20,000 barriers inside one region, microseconds per each. */
#include <omp.h>
#include <stdio.h>
int main() {
    volatile int sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t = omp_get_wtime();
        for (int i = 0; i < 20000; i++) {
#pragma omp parallel num_threads(2)
            { sink += omp_get_thread_num(); }
        }
        double dt = omp_get_wtime() - t;
        t = omp_get_wtime();
#pragma omp parallel num_threads(2)
        for (int i = 0; i < 20000; i++) {
#pragma omp barrier
        }
        double db = omp_get_wtime() - t;
        printf("region %.2f us  barrier %.2f us\n", dt / 20000 * 1e6, db / 20000 * 1e6);
    }
}
