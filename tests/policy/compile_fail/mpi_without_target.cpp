// Must not compile: mpi_communicator through the umbrella header in a target not linked with
// lockstep::mpi (the stub's sentence names the target). SPDX-License-Identifier: Apache-2.0
#include "lockstep/lockstep.hpp"
int main() {
    lockstep::mpi_communicator comm(0);
    (void)comm;
}
