// The "aten" backend's native executor: an FX graph of ATen ops as a flat program of boxed
// dispatcher calls, run from C++ without returning to Python between ops.
//
// Each op is called exactly as `OpOverload.__call__` calls it (the same operator handle, the
// same boxed arguments, defaults filled in from the schema), so results are bit for bit the
// Python executor's; only the per-op cost of parsing Python arguments is gone. Values live in
// numbered registers; a register is cleared after its last use, as the Python executor's
// `del` does. An op whose call is a Python function taking its inputs over (a compiled region,
// `functrans.extend.handover_call`) is a "pycall" step: the list it gets holds the only
// references to the inputs whose last use it is. Built and loaded by `functrans.codegen._native`.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// A register (reg >= 0) or a constant. A Python number passed where the schema says Tensor
// becomes a fresh wrapped-number tensor on every run, as OpOverload.__call__ makes one per
// call: an op that returns its input as is must not hand one run's tensor to the next.
struct Source {
  int reg = -1;
  c10::IValue value;
  std::optional<c10::Scalar> number;  // set: make a fresh tensor like `value` per run
  c10::IValue get(const std::vector<c10::IValue>& regs) const {
    if (reg >= 0) {
      return regs[reg];
    }
    if (!number) {
      return value;
    }
    const auto& t = value.toTensor();
    auto copy = at::detail::scalar_tensor_static(*number, t.scalar_type(), t.device());
    copy.unsafeGetTensorImpl()->set_wrapped_number(t.unsafeGetTensorImpl()->is_wrapped_number());
    return copy;
  }
};

// One argument of a call: a single value, or a list assembled on every run (tensors, or the
// sizes of a graph with symbolic shapes)
struct Arg {
  enum Kind { kValue, kTensors, kOptionalTensors, kInts } kind = kValue;
  Source one;
  bool number_as_tensor = false;  // a register that may hold a size where the schema says Tensor
  std::vector<Source> items;
};

class Program;

struct Step {
  std::optional<c10::OperatorHandle> op;  // none: item `index` of the list in args[0]
  int64_t index = 0;
  std::vector<Arg> args;
  std::vector<int> outs;   // a register per return, -1 for returns nobody reads
  std::vector<int> frees;  // registers whose last use is this step
  std::string name;        // the FX node, for error messages
  bool numbers = false;    // numbers may stand for tensors (also in kernels it redispatches to)
  char arith = 0;          // no op: integer arithmetic on sizes (+ - * / % n(eg) <(min) >(max))
  py::object fn;           // set: a pycall, fn(list of the registers in args[0].items) -> list
  const Program* sub = nullptr;  // set (fn holds it): that program run on the registers
  std::vector<int64_t> picks;    // ... and these of its outputs, as one list
};

// Python's integer semantics (floor division and modulo round towards -infinity)
int64_t arithmetic(char code, int64_t a, int64_t b) {
  switch (code) {
    case '+': return a + b;
    case '-': return a - b;
    case '*': return a * b;
    case 'n': return -a;
    case '<': return std::min(a, b);
    case '>': return std::max(a, b);
    case '/':
    case '%': {
      TORCH_CHECK(b != 0, "integer division by zero in a size computation");
      int64_t q = a / b, r = a % b;
      if (r != 0 && ((r < 0) != (b < 0))) {
        q -= 1;
        r += b;
      }
      return code == '/' ? q : r;
    }
  }
  TORCH_CHECK(false, "unknown size arithmetic ", code);
}

// A tensor, None, bool, int or float (get_attr values, constant outputs)
c10::IValue from_python(py::handle value) {
  PyObject* obj = value.ptr();
  if (THPVariable_Check(obj)) {
    return THPVariable_Unpack(obj);
  }
  if (value.is_none()) {
    return c10::IValue();
  }
  if (PyBool_Check(obj)) {
    return value.cast<bool>();
  }
  if (PyLong_Check(obj)) {
    return value.cast<int64_t>();
  }
  TORCH_CHECK(PyFloat_Check(obj), "the native executor takes no ", py::str(value.get_type()));
  return value.cast<double>();
}

Source constant(py::handle value, const c10::TypePtr& type) {
  Source s;
  s.value = torch::jit::toIValue(value, type);
  if (s.value.isTensor() && !THPVariable_Check(value.ptr())) {
    const auto& t = s.value.toTensor();
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 0, "a number as a tensor: ", t);
    s.number = t.item();
  }
  return s;
}

// ("r", reg) | ("c", value) for an element of a list argument
Source element(py::handle spec, const c10::TypePtr& type) {
  auto t = py::reinterpret_borrow<py::tuple>(spec);
  if (t[0].cast<std::string>() == "r") {
    Source s;
    s.reg = t[1].cast<int>();
    TORCH_CHECK(s.reg >= 0, "register ", s.reg);
    return s;
  }
  return constant(t[1], type);
}

class Program {
 public:
  int num_registers = 0;
  std::vector<int> inputs;

  // A call of `name.overload`; `args` has one spec per schema argument:
  // ("r", reg) | ("c", value) | ("d",) (the schema's default) | ("l", [("r"|"c", ...), ...])
  void call(const std::string& name, const std::string& overload, const std::string& node,
            const py::list& args, std::vector<int> outs, std::vector<int> frees) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(args.size() == schema.arguments().size(), node, ": ", args.size(),
                " argument specs for ", schema);
    TORCH_CHECK(outs.size() == schema.returns().size(), node, ": ", outs.size(),
                " outputs for ", schema);
    // Python numbers where the schema says Tensor, exactly where OpOverload.__call__ takes them
    auto symbol = c10::Symbol::fromQualString(schema.name());
    Step step;
    step.numbers = symbol.is_prims() || (symbol.is_aten() && torch::should_allow_numbers_as_tensors(
                                                                 symbol.toUnqualString()));
    torch::jit::ToIValueAllowNumbersAsTensors numbers(step.numbers);
    step.op = op;
    for (size_t i = 0; i < args.size(); ++i) {
      const auto& formal = schema.arguments()[i];
      auto spec = py::reinterpret_borrow<py::tuple>(args[i]);
      auto kind = spec[0].cast<std::string>();
      Arg arg;
      if (kind == "d") {
        TORCH_CHECK(formal.default_value().has_value(), node, ": no value for ", formal.name());
        arg.one.value = *formal.default_value();
      } else if (kind == "l") {
        auto list = formal.real_type()->cast<c10::ListType>();
        TORCH_CHECK(list, node, ": a list of values for ", formal.name(), " of ", schema);
        auto elem = list->getElementType();
        if (elem->kind() == c10::TypeKind::TensorType) {
          arg.kind = Arg::kTensors;
        } else if (elem->kind() == c10::TypeKind::IntType ||
                   elem->kind() == c10::TypeKind::SymIntType) {
          arg.kind = Arg::kInts;
        } else if (elem->kind() == c10::TypeKind::OptionalType &&
                   elem->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                       c10::TypeKind::TensorType) {
          arg.kind = Arg::kOptionalTensors;
        } else {
          TORCH_CHECK(false, node, ": graph values inside ", formal.name(), " of ", schema);
        }
        for (auto item : py::reinterpret_borrow<py::list>(spec[1])) {
          arg.items.push_back(element(item, elem));
        }
      } else {
        arg.one = element(spec, formal.real_type());
        arg.number_as_tensor = arg.one.reg >= 0 && step.numbers &&
                               formal.real_type()->kind() == c10::TypeKind::TensorType;
      }
      step.args.push_back(std::move(arg));
    }
    add(std::move(step), std::move(outs), node, std::move(frees));
  }

  // out = src[index], for ops that return a list of tensors
  void item(int src, int64_t index, int out, const std::string& node, std::vector<int> frees) {
    Step step;
    step.index = index;
    Arg arg;
    arg.one.reg = src;
    step.args.push_back(std::move(arg));
    add(std::move(step), {out}, node, std::move(frees));
  }

  // out = a <code> b on integers (sizes of a graph with symbolic shapes); `a`, `b` are
  // ("r", reg) | ("c", int) specs (`b` ignored for negation)
  void arith(const std::string& code, const py::tuple& a, const py::tuple& b, int out,
             const std::string& node, std::vector<int> frees) {
    TORCH_CHECK(code.size() == 1 && std::string("+-*/%n<>").find(code[0]) != std::string::npos,
                node, ": unknown size arithmetic ", code);
    Step step;
    step.arith = code[0];
    for (const auto& spec : {a, b}) {
      Arg arg;
      arg.one = element(spec, c10::IntType::get());
      step.args.push_back(std::move(arg));
    }
    add(std::move(step), {out}, node, std::move(frees));
  }

  // out = fn([regs...]) for a Python function that takes its list over: the registers in
  // `frees` are cleared before the call, so the list holds their only references
  void pycall(py::object fn, const std::vector<int>& regs, int out, const std::string& node,
              std::vector<int> frees) {
    Step step = on_registers(regs);
    step.fn = std::move(fn);
    add(std::move(step), {out}, node, std::move(frees));
  }

  // out = [outputs `picks` of `program`] run on the registers `regs`, from C++: a pycall whose
  // function is another program's call_boxed (a compiled region), without Python between
  void subcall(py::object program, std::vector<int64_t> picks, const std::vector<int>& regs,
               int out, const std::string& node, std::vector<int> frees) {
    const Program* sub = program.cast<const Program*>();
    TORCH_CHECK(regs.size() == sub->inputs.size(), node, ": ", regs.size(), " inputs for a ",
                "program of ", sub->inputs.size());
    for (int64_t k : picks) {
      TORCH_CHECK(k >= 0 && static_cast<size_t>(k) < sub->outputs_.size(), node, ": output ", k,
                  " of ", sub->outputs_.size());
    }
    Step step = on_registers(regs);
    step.fn = std::move(program);  // keeps `sub` alive
    step.sub = sub;
    step.picks = std::move(picks);
    add(std::move(step), {out}, node, std::move(frees));
  }

  int num_outputs() const { return static_cast<int>(outputs_.size()); }

  // A value placed in `reg` before every run (get_attr nodes)
  void constant_register(int reg, py::handle value) {
    constants_.emplace_back(reg, from_python(value));
  }

  // ("r", reg) | ("c", value) per output
  void set_outputs(const py::list& outs) {
    for (int r : inputs) {
      check_register(r, "an input");
    }
    outputs_.clear();
    for (auto o : outs) {
      auto t = py::reinterpret_borrow<py::tuple>(o);
      Source s;
      if (t[0].cast<std::string>() == "r") {
        s.reg = t[1].cast<int>();
        check_register(s.reg, "an output");
      } else {
        s.value = from_python(t[1]);
      }
      outputs_.push_back(std::move(s));
    }
  }

  // What runs the graph when the program must not: inputs that are not tensors, or that
  // __torch_function__ (a subclass override, a mode) would intercept as OpOverload calls are
  void set_fallback(py::object fallback) { fallback_ = std::move(fallback); }

  py::object run(const py::args& values) { return run_sequence(values, false); }

  // The boxed convention: `values` is a list the program empties once its registers hold the
  // values, so each input is freed after its last use (a backward's saved values)
  py::object run_boxed(const py::list& values) { return run_sequence(values, true); }

 private:
  // Every step ends here: its outputs, the registers whose last use it is, its node's name
  void add(Step step, std::vector<int> outs, const std::string& node, std::vector<int> frees) {
    step.outs = std::move(outs);
    step.frees = std::move(frees);
    step.name = node;
    check(step);
    steps_.push_back(std::move(step));
  }

  // A step whose one argument is the list of the registers `regs` (pycall, subcall)
  static Step on_registers(const std::vector<int>& regs) {
    Step step;
    Arg arg;
    arg.kind = Arg::kTensors;
    for (int r : regs) {
      Source src;
      src.reg = r;
      arg.items.push_back(std::move(src));
    }
    step.args.push_back(std::move(arg));
    return step;
  }

  py::object run_sequence(py::handle seq, bool boxed) {
    PyObject* obj = seq.ptr();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    TORCH_CHECK(static_cast<size_t>(n) == inputs.size(), "the graph takes ", inputs.size(),
                " inputs, got ", n);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    if (!plain_tensors(seq, items, n)) {
      TORCH_CHECK(fallback_, "the native executor has no fallback for these inputs");
      py::tuple args = py::reinterpret_steal<py::tuple>(PySequence_Tuple(obj));
      if (boxed) {
        clear(obj);
      }
      return fallback_(*args);
    }
    std::vector<c10::IValue> regs(num_registers);
    for (const auto& [reg, value] : constants_) {
      regs[reg] = value;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = items[i];
      regs[inputs[i]] = THPVariable_Check(v) ? c10::IValue(THPVariable_Unpack(v))
                                             : c10::IValue(py::handle(v).cast<int64_t>());
    }
    if (boxed) {
      clear(obj);  // the registers now hold the only references this call keeps
    }
    {
      py::gil_scoped_release no_gil;
      execute(regs);
    }
    py::list out;
    for (const auto& s : outputs_) {
      out.append(torch::jit::toPyObject(s.get(regs)));
    }
    return out;
  }

  static void clear(PyObject* list) {
    if (PyList_SetSlice(list, 0, PyList_GET_SIZE(list), nullptr) != 0) {
      throw py::error_already_set();
    }
  }

  // Every register a step names exists: a bad index is a build error, never a stray write
  void check_register(int r, const char* what) const {
    TORCH_CHECK(r >= 0 && r < num_registers, what, " names register ", r, " of ",
                num_registers);
  }

  void check(const Step& s) const {
    for (const auto& a : s.args) {
      if (a.kind == Arg::kValue && a.one.reg >= 0) {
        check_register(a.one.reg, s.name.c_str());
      }
      for (const auto& i : a.items) {
        if (i.reg >= 0) {
          check_register(i.reg, s.name.c_str());
        }
      }
    }
    if (!s.op && !s.arith && !s.fn) {
      check_register(s.args.at(0).one.reg, s.name.c_str());
    }
    for (int r : s.outs) {
      if (r != -1 || !s.op) {
        check_register(r, s.name.c_str());
      }
    }
    for (int r : s.frees) {
      check_register(r, s.name.c_str());
    }
  }

  static bool plain_tensors(py::handle values, PyObject** items, Py_ssize_t n) {
    bool subclass = false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = items[i];
      if (PyLong_CheckExact(v)) {
        continue;  // a size (a dynamic forward hands its backward sizes)
      }
      if (!THPVariable_Check(v)) {
        return false;
      }
      subclass = subclass || !THPVariable_CheckExact(v);
    }
    if (at::impl::torch_function_mode_enabled()) {
      return false;
    }
    if (!subclass) {
      return true;
    }
    // torch._C._has_torch_function: does a subclass override __torch_function__? (leaked on
    // purpose: it must outlive the interpreter's teardown of this module)
    static auto* has_torch_function =
        new py::object(py::module_::import("torch._C").attr("_has_torch_function"));
    return !(*has_torch_function)(values).cast<bool>();
  }

  void execute(std::vector<c10::IValue>& regs) const {
    torch::jit::Stack stack;
    for (const auto& s : steps_) {
      if (s.arith) {
        int64_t a = s.args[0].one.get(regs).toInt();
        int64_t b = s.arith == 'n' ? 0 : s.args[1].one.get(regs).toInt();
        regs[s.outs[0]] = arithmetic(s.arith, a, b);
      } else if (s.sub) {
        run_subcall(s, regs);  // clears its frees itself, before the call
        continue;
      } else if (s.fn) {
        run_pycall(s, regs);  // clears its frees itself, before the call
        continue;
      } else if (!s.op) {
        regs[s.outs[0]] = regs[s.args[0].one.reg].toListRef().at(s.index);
      } else {
        stack.clear();
        for (const auto& a : s.args) {
          push(a, regs, stack);
        }
        try {
          torch::jit::ToIValueAllowNumbersAsTensors numbers(s.numbers);
          s.op->callBoxed(stack);
        } catch (c10::Error& e) {
          e.add_context(c10::str("functrans: while running node ", s.name));
          throw;
        }
        for (size_t i = 0; i < s.outs.size(); ++i) {
          if (s.outs[i] >= 0) {
            regs[s.outs[i]] = std::move(stack[i]);
          }
        }
      }
      for (int r : s.frees) {
        regs[r] = c10::IValue();
      }
    }
  }

  static void run_subcall(const Step& s, std::vector<c10::IValue>& regs) {
    const Program& p = *s.sub;
    std::vector<c10::IValue> inner(p.num_registers);
    for (const auto& [reg, value] : p.constants_) {
      inner[reg] = value;
    }
    const auto& items = s.args[0].items;
    for (size_t i = 0; i < items.size(); ++i) {
      inner[p.inputs[i]] = regs[items[i].reg];
    }
    for (int r : s.frees) {
      regs[r] = c10::IValue();  // `inner` now holds the only references to these
    }
    p.execute(inner);
    c10::List<at::Tensor> out;
    for (int64_t k : s.picks) {
      auto v = p.outputs_[k].get(inner);
      TORCH_CHECK(v.isTensor(), "functrans: node ", s.name, " returned a non-tensor");
      out.push_back(v.toTensor());
    }
    regs[s.outs[0]] = std::move(out);
    for (int r : s.frees) {
      if (r == s.outs[0]) {
        regs[r] = c10::IValue();  // a result nobody reads
      }
    }
  }

  static void run_pycall(const Step& s, std::vector<c10::IValue>& regs) {
    py::gil_scoped_acquire gil;
    const auto& items = s.args[0].items;
    py::list args(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      args[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(regs[items[i].reg].toTensor()));
    }
    for (int r : s.frees) {
      regs[r] = c10::IValue();
    }
    py::object result = s.fn(args);  // empties `args`: each input dies after its last use
    c10::List<at::Tensor> out;
    for (auto v : result) {
      TORCH_CHECK(THPVariable_Check(v.ptr()), "functrans: node ", s.name,
                  " returned a non-tensor: ", py::str(v.get_type()));
      out.push_back(THPVariable_Unpack(v.ptr()));
    }
    regs[s.outs[0]] = std::move(out);
    for (int r : s.frees) {
      if (r == s.outs[0]) {
        regs[r] = c10::IValue();  // a result nobody reads
      }
    }
  }

  static void push(const Arg& a, const std::vector<c10::IValue>& regs, torch::jit::Stack& stack) {
    if (a.kind == Arg::kValue) {
      const auto& v = a.one.get(regs);
      if (a.number_as_tensor && (v.isInt() || v.isDouble())) {
        // a size computed in the graph, passed where the schema says Tensor: a fresh
        // wrapped-number tensor, as OpOverload.__call__ makes of a Python number
        auto t = c10::scalar_to_tensor(v.toScalar());
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        stack.emplace_back(std::move(t));
        return;
      }
      stack.push_back(v);
    } else if (a.kind == Arg::kInts) {
      c10::List<int64_t> list;
      list.reserve(a.items.size());
      for (const auto& i : a.items) {
        list.push_back(i.get(regs).toInt());
      }
      stack.emplace_back(std::move(list));
    } else if (a.kind == Arg::kTensors) {
      c10::List<at::Tensor> list;
      list.reserve(a.items.size());
      for (const auto& i : a.items) {
        list.push_back(i.get(regs).toTensor());
      }
      stack.emplace_back(std::move(list));
    } else {
      c10::List<std::optional<at::Tensor>> list;
      list.reserve(a.items.size());
      for (const auto& i : a.items) {
        const auto& v = i.get(regs);
        list.push_back(v.isNone() ? std::nullopt : std::optional<at::Tensor>(v.toTensor()));
      }
      stack.emplace_back(std::move(list));
    }
  }

  std::vector<Step> steps_;
  std::vector<std::pair<int, c10::IValue>> constants_;
  std::vector<Source> outputs_;
  py::object fallback_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program>(m, "Program")
      .def(py::init<>())
      .def_readwrite("num_registers", &Program::num_registers)
      .def_readwrite("inputs", &Program::inputs)
      .def("call", &Program::call)
      .def("item", &Program::item)
      .def("arith", &Program::arith)
      .def("pycall", &Program::pycall)
      .def("subcall", &Program::subcall)
      .def_property_readonly("num_outputs", &Program::num_outputs)
      .def("constant_register", &Program::constant_register)
      .def("set_outputs", &Program::set_outputs)
      .def("set_fallback", &Program::set_fallback)
      .def("run", [](Program& p, const py::args& values) -> py::object {
        HANDLE_TH_ERRORS
        return p.run(values);
        END_HANDLE_TH_ERRORS_PYBIND
      })
      .def("__call__", [](Program& p, const py::args& values) -> py::object {
        HANDLE_TH_ERRORS
        return p.run(values);
        END_HANDLE_TH_ERRORS_PYBIND
      })
      .def("call_boxed", [](Program& p, const py::list& values) -> py::object {
        HANDLE_TH_ERRORS
        return p.run_boxed(values);
        END_HANDLE_TH_ERRORS_PYBIND
      });
}
