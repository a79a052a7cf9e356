// Package numa computes which CPUs a worker is bound to under torchrun's
// --numa-binding modes (PyTorch 2.14, torch/numa/binding.py), from the
// kernel's view of the machine in sysfs. It reads files and computes; it
// never changes a process's affinity (the launcher does that).
//
// What is read, all under a root directory ("/" on a real machine, a
// fake tree in tests):
//
//   - sys/devices/system/node/nodeN/cpulist: each NUMA node's CPUs;
//   - sys/devices/system/cpu/cpuN/topology/physical_package_id (socket),
//     topology/thread_siblings_list (physical core) and
//     cache/indexK/{type,level,shared_cpu_list} (the largest data or
//     unified cache: the L3 of a core complex);
//   - sys/bus/pci/devices/ADDR/{vendor,class,numa_node}: the GPUs and
//     their NUMA nodes;
//   - proc/driver/nvidia/gpus/ADDR/information: each GPU's UUID, for
//     CUDA_VISIBLE_DEVICES entries that name one.
//
// PyTorch asks CUDA for device i's PCI domain, bus and device numbers and
// reads sys/bus/pci/devices/DDDD:BB:DD.0/numa_node. gorun cannot call
// CUDA (it is a static binary without libcuda), so it finds the same PCI
// functions without a GPU library: NVIDIA's vendor id 0x10de with a
// display class (0x0300 VGA or 0x0302 3D controller), in PCI address
// order, which is CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID and
// nvidia-smi's. CUDA's default order (FASTEST_FIRST) is the same on a
// node of one GPU model, the case of every multi-GPU training node;
// CUDA_VISIBLE_DEVICES then picks and reorders them (Visible) as CUDA
// does.
package numa
