// A stand-in for NCCL on the emulated GPU, so that the NCCL process group (src/dist/nccl.cpp) and
// sharded training over it run on CPU ranks: several processes of an mpirun job, each with its own
// emulated device (tests/simt/fake_cuda_runtime.cpp), exchange their device buffers over MPI.
//
// It keeps NCCL's contract and is stricter where NCCL would silently go wrong:
//   - every buffer must be memory of the communicator's device (the device current at
//     ncclCommInitRank), whole: a host pointer, another device's memory or an overrun is
//     ncclInvalidArgument with a message, where NCCL would fault or corrupt;
//   - send and receive buffers either coincide in NCCL's in-place layout or do not overlap;
//   - reductions are deterministic and the same on every rank: all inputs are exchanged, then
//     summed (or maxed) in rank order in fp32 (fp64 for fp64, exactly for integers) and rounded
//     once to the buffer's type. NCCL's ring rounds after each hop, so 16-bit sums may differ from
//     it in the last bit; tests compare with tolerances where NCCL's own order would matter.
// Every call completes before it returns, like the fake runtime's streams; the stream argument is
// not used. A one-rank communicator needs no MPI (ncclCommInitAll, or a unique id used alone).
//
// Communicators are formed without a collective over MPI_COMM_WORLD, as NCCL needs none: the
// unique id names its maker's world rank and a number it has not used before; each member tells
// the maker its group rank, the maker answers with the member list, and all of them call
// MPI_Comm_create_group (collective over the members alone).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "shardtrain/core/dtype.h"

struct ncclComm {
  int rank = 0;
  int size = 1;
  int device = 0;
  MPI_Comm mpi = MPI_COMM_NULL;  // null for one rank
};

namespace {

constexpr char kMagic[] = "shardtrain-fake-nccl";
// Tags of the rendezvous messages on MPI_COMM_WORLD, above any the project's own code would use
// there (it uses none: its point-to-point traffic goes through communicators of its own).
constexpr int kTagBase = 20000;
constexpr int kTagRange = 10000;

struct IdContents {
  char magic[sizeof(kMagic)];
  int maker;          // world rank of the process that made the id; -1 without MPI
  uint64_t sequence;  // ids made by that process so far
};
static_assert(sizeof(IdContents) <= sizeof(ncclUniqueId));

bool mpi_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

ncclResult_t fail(ncclResult_t result, const char* what) {
  std::fprintf(stderr, "fake NCCL: %s\n", what);
  return result;
}

size_t element_bytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

// [p, p + bytes) lies in memory of `device` (an allocation of the fake runtime, checked at both
// ends).
bool on_device(const void* p, size_t bytes, int device) {
  if (bytes == 0) return true;
  const char* last = static_cast<const char*>(p) + bytes - 1;
  for (const void* q : {p, static_cast<const void*>(last)}) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, q) != cudaSuccess || a.type != cudaMemoryTypeDevice ||
        a.device != device)
      return false;
  }
  return true;
}

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// The start of every collective: a communicator, and a data type the fake models, whose element
// size it returns through `element` (what `comm` holds is read only after this).
ncclResult_t check_call(const ncclComm* comm, ncclDataType_t type, const char* call,
                        size_t* element) {
  if (comm == nullptr) {
    std::fprintf(stderr, "fake NCCL: %s on a null communicator\n", call);
    return ncclInvalidArgument;
  }
  *element = element_bytes(type);
  if (*element == 0) {
    std::fprintf(stderr, "fake NCCL: %s: unknown data type\n", call);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t check_buffers(const ncclComm* comm, const void* send, size_t send_bytes,
                           const void* recv, size_t recv_bytes, const char* call) {
  // MPI counts are ints; the fake carries test-sized buffers.
  if (std::max(send_bytes, recv_bytes) > static_cast<size_t>(INT_MAX))
    return fail(ncclInvalidUsage, "a buffer over 2 GiB, more than the fake carries");
  if (!on_device(send, send_bytes, comm->device) || !on_device(recv, recv_bytes, comm->device)) {
    std::fprintf(stderr,
                 "fake NCCL: %s: a buffer (%p, %zu bytes or %p, %zu bytes) is not wholly memory "
                 "of the communicator's device %d\n",
                 call, send, send_bytes, recv, recv_bytes, comm->device);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

// Every rank's `bytes` from `mine`, in rank order.
std::vector<char> gather_all(const ncclComm* comm, const void* mine, size_t bytes) {
  std::vector<char> all(bytes * static_cast<size_t>(comm->size));
  if (comm->size == 1) {
    std::memcpy(all.data(), mine, bytes);
  } else {
    MPI_Allgather(mine, static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes),
                  MPI_BYTE, comm->mpi);
  }
  return all;
}

template <typename Acc, typename Load, typename Store>
void reduce_rows(const char* rows, int count_rows, size_t n, size_t elem, ncclRedOp_t op, void* out,
                 Load load, Store store) {
  for (size_t i = 0; i < n; ++i) {
    Acc acc = load(rows + i * elem);
    for (int r = 1; r < count_rows; ++r) {
      const Acc v = load(rows + (static_cast<size_t>(r) * n + i) * elem);
      acc = op == ncclMax ? std::max(acc, v) : acc + v;
    }
    store(static_cast<char*>(out) + i * elem, acc);
  }
}

template <typename T>
T load_as(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store_as(char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Rows of a type that is summed as itself (fp32 in fp32, fp64 in fp64, integers exactly).
template <typename T>
void reduce_native_rows(const char* rows, int count_rows, size_t n, ncclRedOp_t op, void* out) {
  reduce_rows<T>(rows, count_rows, n, sizeof(T), op, out, load_as<T>, store_as<T>);
}

// A 16-bit float type's rows, widened to fp32, reduced, rounded once.
void reduce_16bit_rows(const char* rows, int count_rows, size_t n, ncclRedOp_t op, void* out,
                       float (*widen)(uint16_t), uint16_t (*round)(float)) {
  reduce_rows<float>(
      rows, count_rows, n, sizeof(uint16_t), op, out,
      [widen](const char* p) { return widen(load_as<uint16_t>(p)); },
      [round](char* p, float v) { store_as<uint16_t>(p, round(v)); });
}

// out[i] = op over the `count_rows` rows of `rows` (each n elements of `type`), in row order.
ncclResult_t reduce(const char* rows, int count_rows, size_t n, ncclDataType_t type, ncclRedOp_t op,
                    void* out) {
  using shardtrain::bf16_to_float;
  using shardtrain::f16_to_float;
  using shardtrain::float_to_bf16;
  using shardtrain::float_to_f16;
  if (op != ncclSum && op != ncclMax)
    return fail(ncclInvalidArgument, "only sum and max are faked");
  const size_t e = element_bytes(type);
  switch (type) {
    case ncclFloat32:
      reduce_native_rows<float>(rows, count_rows, n, op, out);
      return ncclSuccess;
    case ncclFloat64:
      reduce_native_rows<double>(rows, count_rows, n, op, out);
      return ncclSuccess;
    case ncclBfloat16:
      reduce_16bit_rows(rows, count_rows, n, op, out, bf16_to_float, float_to_bf16);
      return ncclSuccess;
    case ncclFloat16:
      reduce_16bit_rows(rows, count_rows, n, op, out, f16_to_float, float_to_f16);
      return ncclSuccess;
    case ncclInt32:
      reduce_native_rows<int32_t>(rows, count_rows, n, op, out);
      return ncclSuccess;
    case ncclInt64:
      reduce_native_rows<int64_t>(rows, count_rows, n, op, out);
      return ncclSuccess;
    case ncclUint8:
      reduce_rows<unsigned>(
          rows, count_rows, n, e, op, out,
          [](const char* p) { return unsigned{load_as<uint8_t>(p)}; },
          [](char* p, unsigned v) { store_as<uint8_t>(p, static_cast<uint8_t>(v)); });
      return ncclSuccess;
    default:
      return fail(ncclInvalidArgument, "a reduction over a data type the fake does not model");
  }
}

uint64_t next_sequence() {
  static uint64_t sequence = 0;
  return sequence++;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclInvalidArgument:
      return "invalid argument (the fake NCCL printed why)";
    case ncclInvalidUsage:
      return "invalid usage (the fake NCCL printed why)";
    case ncclSystemError:
      return "unhandled system error (an MPI call of the fake NCCL failed)";
    default:
      return "an error the fake NCCL does not produce";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  IdContents c{};
  std::memcpy(c.magic, kMagic, sizeof(kMagic));
  c.maker = -1;
  if (mpi_running()) MPI_Comm_rank(MPI_COMM_WORLD, &c.maker);
  c.sequence = next_sequence();
  *id = ncclUniqueId{};
  std::memcpy(id->internal, &c, sizeof(c));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  *out = nullptr;
  IdContents c{};
  std::memcpy(&c, id.internal, sizeof(c));
  if (std::memcmp(c.magic, kMagic, sizeof(kMagic)) != 0)
    return fail(ncclInvalidArgument,
                "ncclCommInitRank: the unique id was not made by ncclGetUniqueId");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "ncclCommInitRank: rank outside [0, nranks)");
  auto comm = new ncclComm{rank, nranks, 0, MPI_COMM_NULL};
  cudaGetDevice(&comm->device);
  if (nranks > 1) {
    if (!mpi_running() || c.maker < 0) {
      delete comm;
      return fail(ncclInvalidUsage,
                  "a communicator of several ranks needs MPI (the fake's transport)");
    }
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const int tag =
        kTagBase +
        static_cast<int>((static_cast<uint64_t>(c.maker) * 1009 + c.sequence) % kTagRange);
    std::vector<int> members(static_cast<size_t>(nranks), -1);
    if (rank == 0) {
      if (world_rank != c.maker) {
        delete comm;
        return fail(ncclInvalidUsage,
                    "rank 0 of a communicator must be the maker of its unique id");
      }
      members[0] = world_rank;
      for (int i = 1; i < nranks; ++i) {
        int their_rank = -1;
        MPI_Status status;
        MPI_Recv(&their_rank, 1, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &status);
        if (their_rank <= 0 || their_rank >= nranks ||
            members[static_cast<size_t>(their_rank)] >= 0) {
          delete comm;
          return fail(ncclInvalidUsage, "two members claimed the same rank");
        }
        members[static_cast<size_t>(their_rank)] = status.MPI_SOURCE;
      }
      for (int i = 1; i < nranks; ++i)
        MPI_Send(members.data(), nranks, MPI_INT, members[static_cast<size_t>(i)], tag,
                 MPI_COMM_WORLD);
    } else {
      MPI_Send(&rank, 1, MPI_INT, c.maker, tag, MPI_COMM_WORLD);
      MPI_Recv(members.data(), nranks, MPI_INT, c.maker, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, nranks, members.data(), &group);
    const int created = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm->mpi);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    int mpi_rank = -1;
    if (created == MPI_SUCCESS) MPI_Comm_rank(comm->mpi, &mpi_rank);
    if (mpi_rank != rank) {
      delete comm;
      return fail(ncclSystemError, "MPI_Comm_create_group did not form the communicator");
    }
  }
  *out = comm;
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (ndev != 1)
    return fail(ncclInvalidUsage, "ncclCommInitAll: the fake models one device per process");
  const int device = devlist != nullptr ? devlist[0] : 0;
  int count = 0;
  cudaGetDeviceCount(&count);
  if (device < 0 || device >= count)
    return fail(ncclInvalidArgument, "ncclCommInitAll: no such device");
  comms[0] = new ncclComm{0, 1, device, MPI_COMM_NULL};
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  if (comm->mpi != MPI_COMM_NULL && mpi_running()) MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return ncclCommDestroy(comm);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (comm == nullptr)
    return fail(ncclInvalidArgument, "ncclCommGetAsyncError on a null communicator");
  *error = ncclSuccess;  // every call has finished, its error already returned
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t) {
  size_t e = 0;
  if (ncclResult_t r = check_call(comm, type, "ncclAllGather", &e); r != ncclSuccess) return r;
  const size_t bytes = send_count * e;
  if (ncclResult_t r = check_buffers(comm, send, bytes, recv,
                                     bytes * static_cast<size_t>(comm->size), "ncclAllGather");
      r != ncclSuccess)
    return r;
  char* my_block = static_cast<char*>(recv) + bytes * static_cast<size_t>(comm->rank);
  if (send != my_block && overlap(send, bytes, recv, bytes * static_cast<size_t>(comm->size)))
    return fail(ncclInvalidArgument, "ncclAllGather: send overlaps recv other than in place");
  const std::vector<char> all = gather_all(comm, send, bytes);
  std::memcpy(recv, all.data(), all.size());
  return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  size_t e = 0;
  if (ncclResult_t r = check_call(comm, type, "ncclReduceScatter", &e); r != ncclSuccess) return r;
  const size_t bytes = recv_count * e, n = static_cast<size_t>(comm->size);
  if (ncclResult_t r = check_buffers(comm, send, bytes * n, recv, bytes, "ncclReduceScatter");
      r != ncclSuccess)
    return r;
  const char* my_block = static_cast<const char*>(send) + bytes * static_cast<size_t>(comm->rank);
  if (recv != my_block && overlap(send, bytes * n, recv, bytes))
    return fail(ncclInvalidArgument, "ncclReduceScatter: recv overlaps send other than in place");
  // Each rank's block for this rank, in rank order, then reduced.
  std::vector<char> blocks(bytes * n);
  if (comm->size == 1) {
    std::memcpy(blocks.data(), send, bytes);
  } else {
    MPI_Alltoall(send, static_cast<int>(bytes), MPI_BYTE, blocks.data(), static_cast<int>(bytes),
                 MPI_BYTE, comm->mpi);
  }
  return reduce(blocks.data(), comm->size, recv_count, type, op, recv);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  size_t e = 0;
  if (ncclResult_t r = check_call(comm, type, "ncclAllReduce", &e); r != ncclSuccess) return r;
  const size_t bytes = count * e;
  if (ncclResult_t r = check_buffers(comm, send, bytes, recv, bytes, "ncclAllReduce");
      r != ncclSuccess)
    return r;
  if (send != recv && overlap(send, bytes, recv, bytes))
    return fail(ncclInvalidArgument, "ncclAllReduce: send overlaps recv other than in place");
  const std::vector<char> all = gather_all(comm, send, bytes);
  return reduce(all.data(), comm->size, count, type, op, recv);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t) {
  size_t e = 0;
  if (ncclResult_t r = check_call(comm, type, "ncclBroadcast", &e); r != ncclSuccess) return r;
  if (root < 0 || root >= comm->size)
    return fail(ncclInvalidArgument, "ncclBroadcast: root outside the communicator");
  const size_t bytes = count * e;
  // Only the root's send buffer is read.
  const bool is_root = comm->rank == root;
  if (ncclResult_t r = check_buffers(comm, is_root ? send : recv, is_root ? bytes : 0, recv, bytes,
                                     "ncclBroadcast");
      r != ncclSuccess)
    return r;
  if (is_root && send != recv) {
    if (overlap(send, bytes, recv, bytes))
      return fail(ncclInvalidArgument, "ncclBroadcast: send overlaps recv other than in place");
    std::memcpy(recv, send, bytes);
  }
  if (comm->size > 1) MPI_Bcast(recv, static_cast<int>(bytes), MPI_BYTE, root, comm->mpi);
  return ncclSuccess;
}

}  // extern "C"
