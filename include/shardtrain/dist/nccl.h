// NCCL collectives on CUDA tensors (builds with CUDA and NCCL only).
//
// The communicator is created from an MPI communicator: rank 0 makes the NCCL unique id and
// MPI broadcasts it. A one-rank group needs no MPI at all (make_single_rank_nccl_group): a
// single-GPU process, or a test of the NCCL path on one GPU without mpirun. Collectives run on a
// dedicated CUDA stream that first waits for the work already queued on the caller's current
// stream; wait() polls the collective's completion event and NCCL's asynchronous error state, and
// after the group's timeout aborts the communicator (ncclCommAbort) and throws DistributedError, so
// a dead peer cannot hang the job forever. 16-bit reductions run natively in NCCL (bf16/f16 sums
// accumulate in that type per hop). Host-number reductions (all_reduce_host) and barriers go over
// the MPI communicator (nothing to do for one rank).
//
// Status: on one GPU its collectives and a one-rank sharded training have run and passed (the
// `cuda_nccl` tests on an H100); across ranks the suite runs it on emulated GPUs with a stand-in
// for NCCL (tests/simt/fake_nccl.cpp). It has not yet run across real GPUs.
#pragma once
// The C API only: Open MPI's deprecated C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <memory>

#include "shardtrain/dist/process_group.h"

namespace shardtrain::dist {

// True when this build links NCCL.
bool nccl_available();

// A group over the ranks of `comm` using CUDA device `device` (which must be this rank's
// current device for the group's lifetime). Throws ConfigError in builds without NCCL and
// DistributedError when NCCL cannot create the communicator.
std::unique_ptr<ProcessGroup> make_nccl_process_group(MPI_Comm comm, int device, double timeout_s);

// A group of this process alone on CUDA device `device`, without MPI: the unique id is made
// locally. Same errors as make_nccl_process_group.
std::unique_ptr<ProcessGroup> make_single_rank_nccl_group(int device, double timeout_s);

}  // namespace shardtrain::dist
