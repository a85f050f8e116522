//! Chat messages to prompt text, as SGLang renders them: the model's `chat_template` from its
//! `tokenizer_config.json`, rendered with a Jinja engine (minijinja) set up as Hugging Face
//! `transformers` sets up jinja2 for `apply_chat_template` (`trim_blocks`, `lstrip_blocks`,
//! loop controls, `tojson`, Python string and dict methods, `raise_exception`,
//! `strftime_now`), with `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and the
//! request's `tools` in scope.
//!
//! The rendered text is then encoded **without** special tokens
//! ([`crate::tokenizer::Tokenizer::encode_rendered`]): the template writes the BOS token
//! itself, and `apply_chat_template(tokenize=True)` adds none. The router and the simulated
//! worker both render here, so they hash the same tokens.

use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

/// The template's name inside the engine.
const NAME: &str = "chat";

/// Why a chat template cannot be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{setting} {path}: cannot read")]
    Read {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{setting} {path}: not a JSON object")]
    NotJson {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{setting} {path}: chat_template must be a string or a list of {{name, template}}")]
    Shape {
        setting: &'static str,
        path: PathBuf,
    },
    #[error("{setting} {path}: the chat template does not compile")]
    Compile {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: JinjaError,
    },
    #[error(
        "no chat template is loaded: the tokenizer path needs a tokenizer_config.json with a \
         chat_template beside it"
    )]
    Missing,
    #[error("messages must be a list of {{\"role\", \"content\"}} objects")]
    Messages,
    #[error("rendering the chat template")]
    Render(#[source] JinjaError),
}

/// A compiled chat template and the special tokens it may write.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// The template of `tokenizer_config.json` next to the tokenizer at `path` (a directory,
    /// or a `tokenizer.json` file in it); `None` when there is no such file or it has no
    /// `chat_template`. A file that exists but cannot be read, parsed or compiled is an error.
    pub fn load(setting: &'static str, path: &Path) -> Result<Option<ChatTemplate>, ChatError> {
        let dir = if path.is_dir() {
            path
        } else {
            path.parent().unwrap_or(Path::new("."))
        };
        let file = dir.join("tokenizer_config.json");
        if !file.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&file).map_err(|source| ChatError::Read {
            setting,
            path: file.clone(),
            source,
        })?;
        let config: Json = serde_json::from_str(&text).map_err(|source| ChatError::NotJson {
            setting,
            path: file.clone(),
            source,
        })?;
        let template = match &config["chat_template"] {
            Json::Null => return Ok(None),
            Json::String(template) => template.clone(),
            // A list of named templates: the default one.
            Json::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .ok_or_else(|| ChatError::Shape {
                    setting,
                    path: file.clone(),
                })?
                .to_string(),
            _ => {
                return Err(ChatError::Shape {
                    setting,
                    path: file,
                });
            }
        };
        ChatTemplate::new(
            template,
            special_token(&config["bos_token"]),
            special_token(&config["eos_token"]),
        )
        .map(Some)
        .map_err(|source| ChatError::Compile {
            setting,
            path: file,
            source,
        })
    }

    /// Compiles `template`.
    pub fn new(
        template: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate, JinjaError> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, template)?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text for `messages` (a JSON list of `{"role", "content", ...}`), with the
    /// assistant's turn opened when `add_generation_prompt`; `tools` as the request gave them.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let valid = messages
            .as_array()
            .is_some_and(|list| list.iter().all(|m| m.is_object() && m["role"].is_string()));
        if !valid {
            return Err(ChatError::Messages);
        }
        let template = self.env.get_template(NAME).map_err(ChatError::Render)?;
        template
            .render(minijinja::context! {
                messages => Value::from(Serde(messages)),
                tools => tools.map(|tools| Value::from(Serde(tools))),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_deref().unwrap_or(""),
                eos_token => self.eos_token.as_deref().unwrap_or(""),
            })
            .map_err(ChatError::Render)
    }
}

/// `"<s>"` or `{"content": "<s>", ...}` (an `AddedToken`), as tokenizer_config.json writes it.
fn special_token(value: &Json) -> Option<String> {
    match value {
        Json::String(token) => Some(token.clone()),
        Json::Object(token) => token.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time in a Python `strftime` format (the directives
/// chat templates use: `%Y %y %m %d %e %B %b %A %a %H %M %S %j %%`; any other is an error).
fn strftime_now(format: String) -> Result<String, JinjaError> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, seconds)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `format` for `unix_seconds` (UTC).
fn strftime(format: &str, unix_seconds: u64) -> Result<String, JinjaError> {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[month as usize - 1] + day + u32::from(is_leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next();
        let piece = match directive {
            Some('Y') => year.to_string(),
            Some('y') => format!("{:02}", year % 100),
            Some('m') => format!("{month:02}"),
            Some('d') => format!("{day:02}"),
            Some('e') => format!("{day:>2}"),
            Some('B') => MONTHS[month as usize - 1].to_string(),
            Some('b') => MONTHS[month as usize - 1][..3].to_string(),
            Some('A') => WEEKDAYS[weekday].to_string(),
            Some('a') => WEEKDAYS[weekday][..3].to_string(),
            Some('H') => format!("{:02}", secs / 3600),
            Some('M') => format!("{:02}", secs / 60 % 60),
            Some('S') => format!("{:02}", secs % 60),
            Some('j') => format!("{yday:03}"),
            Some('%') => "%".to_string(),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Year, month (1-12), day (1-31) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A ChatML template as Qwen2 ships it (abridged: no tools), with a system default.
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn check(template: &str, messages: Json, expected: &str) {
        let chat =
            ChatTemplate::new(template.into(), Some("<s>".into()), Some("</s>".into())).unwrap();
        assert_eq!(chat.render(&messages, None, true).unwrap(), expected);
    }

    #[test]
    fn renders_a_chatml_conversation_with_the_generation_prompt() {
        check(
            CHATML,
            json!([{"role": "user", "content": "Hi"}]),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        );
    }

    #[test]
    fn has_the_hugging_face_helpers() {
        // bos_token, trim_blocks, Python string methods, tojson, loop controls.
        let template = "{{ bos_token }}{% for m in messages %}\n{% if m.role == 'skip' %}{% continue %}{% endif %}\n[{{ m.role.upper() }}] {{ m.content.strip() }}{% endfor %}{{ messages[0] | tojson }}";
        check(
            template,
            json!([{"role": "user", "content": "  hi  "}, {"role": "skip", "content": "x"}]),
            // tojson as Python's json.dumps writes it.
            "<s>[USER] hi{\"content\": \"  hi  \", \"role\": \"user\"}",
        );
    }

    #[test]
    fn raise_exception_refuses_the_conversation() {
        let template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok";
        let chat = ChatTemplate::new(template.into(), None, None).unwrap();
        let error = chat
            .render(&json!([{"role": "assistant", "content": "x"}]), None, true)
            .unwrap_err();
        let chain = format!("{error}: {}", std::error::Error::source(&error).unwrap());
        assert!(
            chain.contains("Conversation roles must start with user"),
            "{chain}"
        );
    }

    #[test]
    fn rejects_messages_that_are_not_a_list_of_roles() {
        let chat = ChatTemplate::new(CHATML.into(), None, None).unwrap();
        for messages in [json!("hi"), json!([{"content": "x"}]), json!([1])] {
            assert!(matches!(
                chat.render(&messages, None, true),
                Err(ChatError::Messages)
            ));
        }
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-07-23 15:04:05 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_747_045;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %e, %y %H:%M:%S %j %%", t).unwrap(),
            "Tuesday July 23, 24 15:04:05 205 %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert!(strftime("%Q", t).is_err());
    }

    #[test]
    fn loads_the_template_next_to_the_tokenizer() {
        let dir = std::env::temp_dir().join(format!("kv-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("tokenizer_config.json");
        let tokenizer = dir.join("tokenizer.json");
        assert!(ChatTemplate::load("--x", &dir).unwrap().is_none());
        let named = json!({"bos_token": {"content": "<s>", "lstrip": false},
                           "chat_template": [{"name": "tool_use", "template": "t"},
                                             {"name": "default", "template": "{{ bos_token }}d"}]});
        std::fs::write(&config, named.to_string()).unwrap();
        let chat = ChatTemplate::load("--x", &tokenizer).unwrap().unwrap();
        assert_eq!(chat.render(&json!([]), None, false).unwrap(), "<s>d");
        for (bad, needle) in [
            ("{", "not a JSON object"),
            (r#"{"chat_template": 3}"#, "chat_template must be"),
            (r#"{"chat_template": "{% for %}"}"#, "does not compile"),
        ] {
            std::fs::write(&config, bad).unwrap();
            let error = ChatTemplate::load("--x", &dir).unwrap_err().to_string();
            assert!(
                error.contains(needle) && error.starts_with("--x "),
                "{error}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
