// The "aten" backend's native executor: an FX graph of ATen ops as a flat program of boxed
// dispatcher calls, run from C++ without returning to Python between ops.
//
// Each op is called exactly as `OpOverload.__call__` calls it (the same operator handle, the
// same boxed arguments, defaults filled in from the schema), so results are bit for bit the
// Python executor's; only the per-op cost of parsing Python arguments is gone. Values live in
// numbered registers; a register is cleared after its last use, as the Python executor's
// `del` does. Built and loaded by `functrans.codegen._native`.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// A register (reg >= 0) or a constant
struct Source {
  int reg = -1;
  c10::IValue value;
  const c10::IValue& get(const std::vector<c10::IValue>& regs) const {
    return reg >= 0 ? regs[reg] : value;
  }
};

// One argument of a call: a single value, or a tensor list assembled on every run
struct Arg {
  enum Kind { kValue, kTensors, kOptionalTensors } kind = kValue;
  Source one;
  std::vector<Source> items;
};

struct Step {
  std::optional<c10::OperatorHandle> op;  // none: item `index` of the list in args[0]
  int64_t index = 0;
  std::vector<Arg> args;
  std::vector<int> outs;   // a register per return, -1 for returns nobody reads
  std::vector<int> frees;  // registers whose last use is this step
  std::string name;        // the FX node, for error messages
};

// A tensor, None, bool, int or float (graph inputs, get_attr values, constant outputs)
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
  return s;
}

// ("r", reg) | ("c", value) for an element of a list argument
Source element(py::handle spec, const c10::TypePtr& type) {
  auto t = py::reinterpret_borrow<py::tuple>(spec);
  if (t[0].cast<std::string>() == "r") {
    Source s;
    s.reg = t[1].cast<int>();
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
    torch::jit::ToIValueAllowNumbersAsTensors numbers(
        symbol.is_prims() ||
        (symbol.is_aten() && torch::should_allow_numbers_as_tensors(symbol.toUnqualString())));
    Step step;
    step.op = op;
    step.outs = std::move(outs);
    step.frees = std::move(frees);
    step.name = node;
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
      }
      step.args.push_back(std::move(arg));
    }
    steps_.push_back(std::move(step));
  }

  // out = src[index], for ops that return a list of tensors
  void item(int src, int64_t index, int out, std::vector<int> frees, const std::string& node) {
    Step step;
    step.index = index;
    Arg arg;
    arg.one.reg = src;
    step.args.push_back(std::move(arg));
    step.outs = {out};
    step.frees = std::move(frees);
    step.name = node;
    steps_.push_back(std::move(step));
  }

  // A value placed in `reg` before every run (get_attr nodes)
  void constant_register(int reg, py::handle value) {
    constants_.emplace_back(reg, from_python(value));
  }

  // ("r", reg) | ("c", value) per output
  void set_outputs(const py::list& outs) {
    outputs_.clear();
    for (auto o : outs) {
      auto t = py::reinterpret_borrow<py::tuple>(o);
      Source s;
      if (t[0].cast<std::string>() == "r") {
        s.reg = t[1].cast<int>();
      } else {
        s.value = from_python(t[1]);
      }
      outputs_.push_back(std::move(s));
    }
  }

  py::list run(const py::args& values) {
    TORCH_CHECK(values.size() == inputs.size(), "the graph takes ", inputs.size(),
                " inputs, got ", values.size());
    std::vector<c10::IValue> regs(num_registers);
    for (const auto& [reg, value] : constants_) {
      regs[reg] = value;
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      regs[inputs[i]] = from_python(values[i]);
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

  std::string listing() const {
    std::ostringstream os;
    for (const auto& s : steps_) {
      os << s.name << " = " << (s.op ? s.op->schema().operator_name().name : "item") << "\n";
    }
    return os.str();
  }

 private:
  void execute(std::vector<c10::IValue>& regs) const {
    torch::jit::Stack stack;
    for (const auto& s : steps_) {
      if (!s.op) {
        regs[s.outs[0]] = regs[s.args[0].one.reg].toListRef().at(s.index);
      } else {
        stack.clear();
        for (const auto& a : s.args) {
          push(a, regs, stack);
        }
        try {
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

  static void push(const Arg& a, const std::vector<c10::IValue>& regs, torch::jit::Stack& stack) {
    if (a.kind == Arg::kValue) {
      stack.push_back(a.one.get(regs));
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
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program>(m, "Program")
      .def(py::init<>())
      .def_readwrite("num_registers", &Program::num_registers)
      .def_readwrite("inputs", &Program::inputs)
      .def("call", &Program::call)
      .def("item", &Program::item)
      .def("constant_register", &Program::constant_register)
      .def("set_outputs", &Program::set_outputs)
      .def("listing", &Program::listing)
      .def("run", [](Program& p, const py::args& values) {
        HANDLE_TH_ERRORS
        return p.run(values);
        END_HANDLE_TH_ERRORS_PYBIND
      });
}
