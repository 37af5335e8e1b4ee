/// @file
/// @brief main() of the MPI test executables: doctest on every rank of MPI_COMM_WORLD.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include <mpi.h>

#include "mpi_fixture.hpp"

/// Runs doctest on every rank (rank 0 reports in full, the others only their failures) and fails
/// on every rank when any rank failed.
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &mpi_test::world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_test::world_size);
  if (const char* bytes = std::getenv("GRADACCUM_TEST_BUCKET_BYTES")) mpi_test::bucket_bytes = std::stoul(bytes);
  doctest::Context context(argc, argv);
  if (mpi_test::world_rank != 0) context.setOption("minimal", true);
  int failed = context.run() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
