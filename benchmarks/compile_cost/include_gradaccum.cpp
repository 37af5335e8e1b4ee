// Compile-cost target (c): what including gradaccum costs a file that uses none of it.
#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include <Eigen/Dense>

int main() {
  return 0;
}
