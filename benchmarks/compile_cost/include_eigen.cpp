// Compile-cost baseline of target (c): Eigen alone, nothing used.
#include <Eigen/Dense>

int main() {
  return 0;
}
